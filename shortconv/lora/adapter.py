"""Read one PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) from disk.

The engine does not import peft: it reads the two files PEFT's `save_pretrained` writes. What
this module checks needs no model (the files, the config's options); the checks against the
model's layers (module names, shapes, rank) are `lora.install`'s.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's key prefix on a causal LM (PeftModelForCausalLM.base_model.model).
_PEFT_PREFIX = "base_model.model."
_PARTS = {"lora_A": 0, "lora_B": 1}


class LoraError(ValueError):
    """An adapter that cannot be loaded, with the module or file and the reason. `reason` is
    its kind, one of `metrics.defs.LORA_LOAD_REFUSALS` (the refusal counter's label)."""

    def __init__(self, message: str, reason: str = "options") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter as read: `weights` maps each HF module name (as the base checkpoint names
    it, PEFT's prefix stripped) to its (A [r, in], B [out, r]); `scale` is alpha/r, or
    alpha/sqrt(r) with rsLoRA. `target_modules` is PEFT's list (or regex string)."""

    path: Path
    rank: int
    scale: float
    target_modules: tuple[str, ...] | str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def tensor_rank(self) -> int:
        """The largest rank its tensors have: what its slot holds (`rank` is the config's)."""
        return max(a.shape[0] for a, _ in self.weights.values())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(path: str | Path) -> LoraAdapter:
    """Read and check an adapter directory; LoraError naming what is wrong."""
    root = Path(path)
    cfg = _read_config(root)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"{root / CONFIG_FILE}: needs an integer r >= 1 and a lora_alpha")
    _refuse_options(root, cfg)
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = cfg.get("target_modules")
    target_modules = targets if isinstance(targets, str) else tuple(sorted(targets or ()))
    weights = _pair_tensors(root, _read_weights(root))
    return LoraAdapter(root, rank, float(scale), target_modules, weights)


def _read_config(root: Path) -> dict:
    file = root / CONFIG_FILE
    if not file.is_file():
        raise LoraError(
            f"{root}: no {CONFIG_FILE} (is this a PEFT LoRA adapter directory?)", "files"
        )
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"{file}: not readable JSON ({exc})", "files") from exc
    if not isinstance(cfg, dict):
        raise LoraError(f"{file}: not a JSON object", "files")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{file}: peft_type {cfg['peft_type']!r} is not LORA")
    return cfg


def _refuse_options(root: Path, cfg: dict) -> None:
    """PEFT options whose math this engine does not implement: refused, not ignored."""
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "bias": cfg.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "target_parameters": bool(cfg.get("target_parameters")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise LoraError(f"{root / CONFIG_FILE}: unsupported PEFT options {bad}")


def _read_weights(root: Path) -> dict[str, torch.Tensor]:
    file = root / WEIGHTS_FILE
    if not file.is_file():
        raise LoraError(f"{root}: no {WEIGHTS_FILE}", "files")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        msg = f"{file}: not a readable safetensors file ({exc})"
        raise LoraError(msg, "files") from exc


def _pair_tensors(
    root: Path, tensors: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A, B)} from PEFT's `<prefix><module>.lora_A.weight` / `.lora_B.weight` keys."""
    parts: dict[str, list[torch.Tensor | None]] = {}
    for key, tensor in tensors.items():
        stem, _, leaf = key.removeprefix(_PEFT_PREFIX).rpartition(".")
        module, _, kind = stem.rpartition(".")
        if leaf != "weight" or kind not in _PARTS or tensor.dim() != 2:
            shape = tuple(tensor.shape)
            raise LoraError(f"{root / WEIGHTS_FILE}: unexpected tensor {key!r} {shape}", "files")
        parts.setdefault(module, [None, None])[_PARTS[kind]] = tensor
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a, b) in parts.items():
        if a is None or b is None:
            msg = f"{root / WEIGHTS_FILE}: {module} has lora_A or lora_B missing"
            raise LoraError(msg, "files")
        if a.shape[0] != b.shape[1]:
            msg = f"{module}: lora_A rank {a.shape[0]} != lora_B rank {b.shape[1]}"
            raise LoraError(msg, "files")
        out[module] = (a, b)
    if not out:
        raise LoraError(f"{root / WEIGHTS_FILE}: no LoRA tensors", "files")
    return out
