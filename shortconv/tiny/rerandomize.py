"""Redraw a fresh transformers model's parameters so that none hides the math (the rules:
shortconv.tiny.checkpoint's docstring)."""

from __future__ import annotations

import math
from typing import Any

import torch

from shortconv.tiny.presets import TOKEN_IDS

LOGIT_GAIN = 3.0
BIAS_FRACTION = 0.1
ROUTING_BIAS_FRACTION = 0.2
_ROUTING_BIASES = ("expert_bias", "balancing_biases")
_SCALE_LIKE_ZERO_INIT = ("qk_norm.temp",)


def _fan_in(name: str, t: torch.Tensor) -> int:
    if t.ndim == 4:
        return math.prod(t.shape[1:])  # Conv2d: (out, in/groups, kh, kw)
    if t.ndim == 3 and "experts" not in name:
        return t.shape[1] * t.shape[2]  # Conv1d: (out, in/groups, kernel)
    return t.shape[-1]  # Linear/Embedding (out, hidden) and fused experts (experts, out, in)


def _uniform(t: torch.Tensor, gen: torch.Generator, low: float, high: float) -> torch.Tensor:
    return torch.rand(t.shape, generator=gen, dtype=torch.float64) * (high - low) + low


def _redraw(name: str, t: torch.Tensor, gen: torch.Generator, scale: float) -> torch.Tensor | None:
    small = scale * BIAS_FRACTION
    if name.endswith(_ROUTING_BIASES):
        bound = scale * ROUTING_BIAS_FRACTION
        new = _uniform(t, gen, -bound, bound).to(t.dtype)
        if name.endswith("balancing_biases"):
            new[-1] = t[-1]  # the skip class keeps its value; see module docstring
        return new
    if t.ndim >= 2:
        gain = LOGIT_GAIN if ("embed_tokens" in name or "lm_head" in name) else 1.0
        std = gain / math.sqrt(_fan_in(name, t))
        return torch.randn(t.shape, generator=gen, dtype=torch.float64) * std
    if bool((t == 1).all()):
        return 1.0 + _uniform(t, gen, -scale, scale)
    if bool((t == 0).all()):
        if any(name.endswith(s) for s in _SCALE_LIKE_ZERO_INIT):
            return 1.0 + _uniform(t, gen, -scale, scale)
        return _uniform(t, gen, -small, small)
    return None  # other 1-D tensors already hold seeded random values


def rerandomize_(model: torch.nn.Module, seed: int, scale: float = 0.5) -> None:
    """Redraw every parameter and persistent float buffer in place (rules: module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: list[tuple[str, torch.Tensor]] = list(model.named_parameters())  # tied: once
    for mod_name, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf_name not in skip and buf is not None and buf.is_floating_point():
                tensors.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, buf))
    with torch.no_grad():
        for name, t in tensors:
            new = _redraw(name, t, gen, scale)
            if new is not None:
                t.copy_(new.to(t.dtype))


def random_vl_model(model_class: type, config: Any, seed: int) -> Any:
    """A re-randomised fp32 transformers vision-language model of `config`, in eval mode, with
    the tiny checkpoints' special token ids for generation."""
    from transformers import GenerationConfig

    # fork_rng: construction draws from the global RNG; seed it without leaking state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    rerandomize_(model, seed)
    model.generation_config = GenerationConfig(**TOKEN_IDS)
    return model.eval()


def set_skip_bias_(model: torch.nn.Module, skip_bias: float) -> int:
    """Set the ZAYA skip-class bias of every router; returns how many routers were changed."""
    n = 0
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("balancing_biases"):
                buf[-1] = float(skip_bias)
                n += 1
    return n
