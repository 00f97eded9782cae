"""ZAYA1 (`ZayaForCausalLM`, transformers model_type "zaya"): ModelConfig fields from ZayaConfig.

Where the installed transformers has no ZayaConfig (the GPU machine's 5.17 predates it), the
same mapper reads `fallback_zaya_config(raw)`: transformers 5.24's ZayaConfig defaults and its
rope-parameter handling, restated, so a config.json means the same on both.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

from shortconv.configs.hf.common import eos_ids
from shortconv.configs.hf.transformers_class import transformers_config
from shortconv.errors import ConfigError

# Fields only the original (alternating attention/MoE layer) Zyphra release has.
LEGACY_CONFIG_KEYS = (
    "zaya_use_eda",
    "zaya_use_mod",
    "zaya_high_prec",
    "ffn_hidden_size",
    "swa_layers",
    "num_query_groups",
    "kv_channels",
    "scale_residual_merge",
    "residual_in_fp32",
)
CONVERTER = "convert_zaya_weights_to_hf.py"
CONVERTER_HINT = (
    f"convert it first with transformers' {CONVERTER} (src/transformers/models/zaya/ in the "
    "transformers source repository; the transformers 5.24 wheel does not ship it): "
    f"python {CONVERTER} --input_dir OLD_DIR --output_dir NEW_DIR"
)

# transformers ACT2FN names → the fused-MoE kernel's activation names (same math).
EXPERT_ACTIVATION_NAMES: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}

# transformers 5.24 ZayaConfig defaults (configuration_zaya.py), for the fallback only.
_ZAYA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262272,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_parameters": None,
    "sliding_window": None,
    "moe_intermediate_size": 2048,
    "num_experts_per_tok": 1,
    "num_experts": 16,
    "layer_types": None,
    "bos_token_id": 2,
    "eos_token_id": 106,
    "head_dim": 128,
    "attention_bias": False,
    "lm_head_bias": False,
    "router_hidden_size": 256,
    "cca_time0": 2,
    "cca_time1": 2,
}
_DEFAULT_ROPE = {
    "hybrid": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
    "hybrid_sliding": {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.5,
    },
}


def expert_activation_name(name: str) -> str:
    """The kernel activation name for a transformers `hidden_act`; ConfigError if unknown."""
    if name not in EXPERT_ACTIVATION_NAMES:
        raise ConfigError(
            f"hidden_act {name!r} is not supported for ZAYA1 experts; "
            f"supported: {', '.join(sorted(EXPERT_ACTIVATION_NAMES))}"
        )
    return EXPERT_ACTIVATION_NAMES[name]


def fallback_zaya_config(raw: dict[str, Any]) -> SimpleNamespace:
    """What ZayaConfig (transformers 5.24) resolves for `raw`: defaults for absent fields,
    all-"hybrid" layer types, the default per-type rope dicts, no top-level `rope_type` and a
    "default" one in each per-type dict."""
    c = SimpleNamespace(**(_ZAYA_DEFAULTS | copy.deepcopy(raw)))
    if c.layer_types is None:
        c.layer_types = ["hybrid"] * c.num_hidden_layers
    if c.rope_parameters is None:
        c.rope_parameters = copy.deepcopy(_DEFAULT_ROPE)
    c.rope_parameters.pop("rope_type", None)
    for per_type in c.rope_parameters.values():
        if isinstance(per_type, dict):
            per_type.setdefault("rope_type", "default")
    return c


def _layer_types(c: Any) -> tuple[str, ...]:
    types, n = list(c.layer_types), int(c.num_hidden_layers)
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    sliding = [i for i, t in enumerate(types) if t == "hybrid_sliding"]
    if sliding:
        raise ConfigError(
            f"ZAYA1 sliding-window CCA layers (layer_types 'hybrid_sliding' at layers {sliding}) "
            "are not supported yet; only 'hybrid' (full attention) layers are"
        )
    unknown = sorted({t for t in types if t != "hybrid"})
    if unknown:
        raise ConfigError(f"unknown ZAYA1 layer types {unknown}; expected 'hybrid'")
    return ("cca",) * n


def _hybrid_rope(c: Any) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of the "hybrid" layers. An absent factor is 1.0, as
    in ZayaRotaryEmbedding (the 0.5 default only comes with an absent rope_parameters)."""
    hybrid = (c.rope_parameters or {}).get("hybrid")
    if not hybrid:
        raise ConfigError("ZAYA1 rope_parameters has no 'hybrid' entry")
    if hybrid.get("rope_type", "default") not in ("default", None):
        raise ConfigError(
            f"ZAYA1 rope_type {hybrid.get('rope_type')!r} is not supported (only 'default')"
        )
    return float(hybrid["rope_theta"]), float(hybrid.get("partial_rotary_factor", 1.0))


def _check_shapes(c: Any, rotary_dim: int) -> None:
    heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    if kv_heads < 1 or heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if (kv_heads * head_dim) % 2:
        raise ConfigError(
            f"num_key_value_heads * head_dim = {kv_heads * head_dim} must be even: ZAYA1 values "
            "are half current-token, half previous-token"
        )
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ConfigError(
            f"rotary dim {rotary_dim} (head_dim * partial_rotary_factor) must be "
            f"even and in (0, head_dim={head_dim}]"
        )
    if c.cca_time0 < 1 or c.cca_time1 < 1:
        raise ConfigError(f"cca_time0/cca_time1 must be >= 1, got {c.cca_time0}/{c.cca_time1}")
    if c.num_experts_per_tok != 1:
        raise ConfigError(
            f"ZAYA1 supports num_experts_per_tok = 1 only, got {c.num_experts_per_tok}"
        )


def zaya1_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """config.json (transformers ZAYA layout) → ModelConfig fields; refuses what we cannot serve."""
    legacy = [k for k in LEGACY_CONFIG_KEYS if k in raw]
    if legacy:
        raise ConfigError(
            f"config.json is in the original Zyphra ZAYA format (fields {legacy}); "
            + CONVERTER_HINT
        )
    c = transformers_config("zaya", raw) or fallback_zaya_config(raw)
    layer_types = _layer_types(c)
    theta, factor = _hybrid_rope(c)
    head_dim = int(c.head_dim)
    rotary_dim = int(head_dim * factor)
    _check_shapes(c, rotary_dim)
    expert_activation_name(str(c.hidden_act))  # refuse an unknown activation at start-up
    return {
        "arch": arch,
        "vocab_size": int(c.vocab_size),
        "hidden_size": int(c.hidden_size),
        "num_layers": int(c.num_hidden_layers),
        "layer_types": layer_types,
        "num_heads": int(c.num_attention_heads),
        "num_kv_heads": int(c.num_key_value_heads),
        "head_dim": head_dim,
        "rope_theta": theta,
        "rotary_dim": rotary_dim,
        "norm_eps": float(c.rms_norm_eps),
        "max_model_len": int(c.max_position_embeddings),
        "intermediate_size": int(c.moe_intermediate_size),
        "tie_word_embeddings": bool(c.tie_word_embeddings),
        "eos_token_ids": eos_ids(c.eos_token_id),
        "bos_token_id": c.bos_token_id,
        "num_experts": int(c.num_experts),
        "num_experts_per_tok": int(c.num_experts_per_tok),
        "moe_intermediate_size": int(c.moe_intermediate_size),
        "num_dense_layers": 0,
        "cca_time0": int(c.cca_time0),
        "cca_time1": int(c.cca_time1),
        "router_hidden_size": int(c.router_hidden_size),
        "attention_bias": bool(c.attention_bias),
        "lm_head_bias": bool(c.lm_head_bias),
        "hidden_act": str(c.hidden_act),
    }
