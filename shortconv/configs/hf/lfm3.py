"""LFM3 (`Lfm3ForCausalLM`, model_type "lfm3"): ModelConfig fields from transformers' Lfm3Config.

LFM3 is LFM2 with two kinds of attention layer, each with its own RoPE: `sliding_attention`
(a window of `sliding_window` keys, default RoPE) and `full_attention` (proportional RoPE);
per-head sigmoid output gates and sandwich norms. Where the installed transformers has no
Lfm3Config (the GPU machine's 5.17 predates it), the same mapper reads
`fallback_lfm3_config(raw)`: transformers 5.24's Lfm3Config defaults and rope handling, restated.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

from shortconv.configs.hf.common import RopeSpec, eos_ids, map_layer_types
from shortconv.configs.hf.transformers_class import transformers_config
from shortconv.errors import ConfigError

# HF layer type → ours.
_LAYER_TYPES = {
    "conv": "conv",
    "full_attention": "attention",
    "sliding_attention": "sliding_attention",
}
_ROPE_LABELS = ("full_attention", "sliding_attention")

# transformers 5.24 Lfm3Config defaults (configuration_lfm3.py), for the fallback only.
_LFM3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 128_000,
    "hidden_size": 2048,
    "intermediate_size": 7680,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128_000,
    "norm_eps": 1e-5,
    "bos_token_id": 124_894,
    "eos_token_id": 124_900,
    "tie_word_embeddings": True,
    "rope_parameters": None,
    "conv_bias": False,
    "conv_L_cache": 7,
    "layer_types": None,
    "head_dim": 128,
    "sliding_window": 256,
    "use_sandwich_norm": True,
    "use_attention_gate": True,
    "attention_bias": False,
}
_DEFAULT_THETA = 1_000_000.0  # Lfm3Config.default_theta: a rope entry without a theta
_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": 0.5,
    },
}


def default_layer_types(n: int) -> list[str]:
    """Lfm3Config's pattern: full attention at i % 4 == 2, sliding at i % 4 == 0 (i > 0)."""
    return [
        "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
        for i in range(n)
    ]


def _fallback_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters as Lfm3Config standardises them: `rope_scaling` is a legacy name, a
    top-level `rope_theta`/`partial_rotary_factor` fills what an entry lacks, `type` names the
    rope_type (else "default")."""
    rope = copy.deepcopy(raw.get("rope_scaling") or raw.get("rope_parameters") or _DEFAULT_ROPE)
    nested = [rope[k] for k in rope if k in _ROPE_LABELS] or [rope]
    theta, factor = raw.get("rope_theta", _DEFAULT_THETA), raw.get("partial_rotary_factor")
    for entry in nested:
        if entry is None:
            continue
        entry.setdefault("rope_theta", theta)
        if factor is not None:
            entry.setdefault("partial_rotary_factor", factor)
        entry.setdefault("rope_type", entry.get("type", "default"))
    return rope


def fallback_lfm3_config(raw: dict[str, Any]) -> SimpleNamespace:
    """What Lfm3Config (transformers 5.24) resolves for `raw`, for the fields we read."""
    c = SimpleNamespace(**(_LFM3_DEFAULTS | copy.deepcopy(raw)))
    if "rms_norm_eps" in raw:  # Lfm3Config.attribute_map
        c.norm_eps = raw["rms_norm_eps"]
    c.rope_parameters = _fallback_rope(raw)
    if c.layer_types is None:
        c.layer_types = default_layer_types(int(c.num_hidden_layers))
    return c


def _rope_spec(c: Any, label: str) -> RopeSpec:
    """The RoPE transformers' Lfm3RotaryEmbedding builds for layers of `label`."""
    entry = (c.rope_parameters or {}).get(label)
    if not isinstance(entry, dict):
        raise ConfigError(f"LFM3 rope_parameters has no {label!r} entry (it must be keyed by type)")
    kind, head_dim = entry.get("rope_type", "default"), int(c.head_dim)
    theta = float(entry["rope_theta"])
    if kind == "default":  # NOTE: Lfm3's default RoPE rotates the whole head, any factor aside
        return RopeSpec(theta, head_dim)
    if kind != "proportional":
        raise ConfigError(
            f"LFM3 {label} rope_type {kind!r} is not supported (only 'default', 'proportional')"
        )
    if float(entry.get("factor", 1.0)) != 1.0:
        raise ConfigError(f"LFM3 {label} proportional RoPE with factor != 1 is not supported")
    angles = int(float(entry.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    return RopeSpec(theta, 2 * angles, proportional=True)


def _ropes(c: Any, types: tuple[str, ...]) -> tuple[tuple[str, RopeSpec], ...]:
    ours = {"full_attention": "attention", "sliding_attention": "sliding_attention"}
    return tuple((ours[t], _rope_spec(c, t)) for t in _ROPE_LABELS if ours[t] in types)


def _sliding_window(c: Any, types: tuple[str, ...]) -> int:
    if "sliding_attention" not in types:
        return 0
    if c.sliding_window is None or int(c.sliding_window) < 1:
        raise ConfigError(
            f"LFM3 has sliding_attention layers but sliding_window = {c.sliding_window!r}"
        )
    return int(c.sliding_window)


def _check_heads(c: Any) -> None:
    heads, kv_heads = int(c.num_attention_heads), int(c.num_key_value_heads)
    if kv_heads < 1 or heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if int(c.head_dim) % 2:
        raise ConfigError(f"LFM3 head_dim must be even for RoPE, got {c.head_dim}")


def lfm3_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """config.json (transformers LFM3 layout) → ModelConfig fields; refuses what we cannot serve."""
    c = transformers_config("lfm3", raw) or fallback_lfm3_config(raw)
    _check_heads(c)
    types = map_layer_types(list(c.layer_types), int(c.num_hidden_layers), _LAYER_TYPES, "LFM3")
    ropes = _ropes(c, types)
    main = dict(ropes).get("attention") or dict(ropes).get("sliding_attention")
    main = main or RopeSpec(_DEFAULT_THETA, int(c.head_dim))  # an all-conv model has no RoPE
    return {
        "arch": arch,
        "vocab_size": int(c.vocab_size),
        "hidden_size": int(c.hidden_size),
        "num_layers": int(c.num_hidden_layers),
        "layer_types": types,
        "num_heads": int(c.num_attention_heads),
        "num_kv_heads": int(c.num_key_value_heads),
        "head_dim": int(c.head_dim),
        "rope_theta": main.theta,
        "rotary_dim": main.rotary_dim,
        "norm_eps": float(c.norm_eps),
        "max_model_len": int(c.max_position_embeddings),
        "intermediate_size": int(c.intermediate_size),
        "tie_word_embeddings": bool(c.tie_word_embeddings),
        "eos_token_ids": eos_ids(c.eos_token_id),
        "bos_token_id": c.bos_token_id,
        "conv_width": int(c.conv_L_cache),
        "conv_bias": bool(c.conv_bias),
        "num_dense_layers": int(c.num_hidden_layers),
        "attention_bias": bool(c.attention_bias),
        "sliding_window": _sliding_window(c, types),
        "rope_by_kind": ropes,
        "attention_gate": bool(c.use_attention_gate),
        "sandwich_norm": bool(c.use_sandwich_norm),
    }
