"""Support registry: every (architecture x device x feature) is served or refused at start-up."""

from __future__ import annotations

import torch

from shortconv.configs.config import ModelConfig
from shortconv.configs.hf.arch import ARCH_BY_CLASS
from shortconv.errors import ConfigError
from shortconv.execution.head_shard import head_shard
from shortconv.kernels import cpu_gemm
from shortconv.kernels.dispatch import resolve_backend
from shortconv.kernels.launch_config import MAX_CONV_WIDTH

# NOTE: every architecture runs on both (kernels.dispatch: Triton on CUDA, torch on CPU).
_DEVICE_TYPES = ("cpu", "cuda")


def check_support(
    cfg: ModelConfig, device: torch.device, tp_size: int, quantization: str = "none"
) -> None:
    """Raise ConfigError naming the unsupported combination; never fail later mid-request."""
    check_quantization(quantization, cfg, device)
    if cfg.arch not in ARCH_BY_CLASS.values():
        raise ConfigError(f"architecture {cfg.arch!r} has no backend")
    if device.type not in _DEVICE_TYPES:
        raise ConfigError(
            f"{cfg.arch} has no short-conv backend for device {device.type!r}; "
            f"supported: {', '.join(_DEVICE_TYPES)}"
        )
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    if cfg.conv_width > MAX_CONV_WIDTH and resolve_backend(device) == "triton":
        # The torch path takes any width; the Triton kernels are bounded (launch_config).
        raise ConfigError(
            f"{cfg.arch}: short-conv width {cfg.conv_width} is wider than the Triton kernels "
            f"take (2..{MAX_CONV_WIDTH}); on CPU set SHORTCONV_KERNELS=torch"
        )
    head_shard(cfg.num_heads, cfg.num_kv_heads, tp_size)  # refuses heads that cannot split
    dims = {"vocab_size": cfg.vocab_size}
    if cfg.arch in ("lfm2", "lfm2_moe", "lfm3", "lfm2_vl", "lfm3_vl"):
        dims["conv channels (hidden_size)"] = cfg.hidden_size
        dims["intermediate_size"] = cfg.intermediate_size
    if cfg.num_experts:
        dims["expert intermediate size (moe_intermediate_size)"] = cfg.moe_intermediate_size
    for what, n in dims.items():
        if n % tp_size:
            raise ConfigError(f"tp_size={tp_size} does not divide {what} = {n}")


def check_quantization(method: str, cfg: ModelConfig, device: torch.device) -> None:
    """`EngineConfig.quantization` for this model on this device, or a ConfigError saying why
    not (before any weight is read)."""
    if method == "none":
        return
    if method not in ("int8", "int4"):
        raise ConfigError(
            f"quantization={method!r} is not implemented yet; supported: 'none', 'int8' and "
            "'int4' (CPU)"
        )
    if device.type != "cpu":
        raise ConfigError(
            f"quantization={method!r} runs on CPU only (our AVX2 q8/q4 kernels); on "
            f"{device.type} use quantization='none'"
        )
    why_not = cpu_gemm.cannot_build()
    if why_not is not None:
        raise ConfigError(f"quantization={method!r} needs the AVX2 CPU kernels: {why_not}")
    if cfg.arch in ("lfm2_vl", "lfm3_vl"):
        raise ConfigError(
            f"quantization={method!r} is not measured for {cfg.arch}'s vision tower yet; serve it "
            "with quantization='none'"
        )
