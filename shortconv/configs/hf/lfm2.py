"""LFM2 / LFM2-MoE: ModelConfig fields from transformers' Lfm2Config / Lfm2MoeConfig.

What transformers resolves for us (and the old hand parse got wrong or refused):
`tie_embedding` overrides `tie_word_embeddings`; `block_ff_dim` overrides `intermediate_size`
for LFM2 only (Lfm2MoeConfig ignores it); `full_attn_idxs` fills `layer_types` for LFM2 only;
an absent field takes the class default (e.g. eos 2, bos 1, LFM2-MoE's 2 dense layers and
expert bias on).
"""

from __future__ import annotations

from typing import Any

from shortconv.configs.hf.common import eos_ids, head_dim_of, map_layer_types
from shortconv.configs.hf.transformers_class import require_transformers_config
from shortconv.errors import ConfigError

_LAYER_TYPES = {"full_attention": "attention", "conv": "conv"}


def mlp_size(c: Any, arch: str) -> int:
    """The dense MLP width the modelling code builds: `intermediate_size`; for LFM2 with
    `block_auto_adjust_ff_dim`, shrunk to 2/3, scaled and rounded up to `block_multiple_of`.

    NOTE: by arch, not by attribute: an LFM2-MoE config.json may carry the LFM2 keys as extras,
    which Lfm2MoeMLP ignores."""
    size = int(c.intermediate_size)
    if arch != "lfm2" or not c.block_auto_adjust_ff_dim:
        return size
    size = int(2 * size / 3)
    if c.block_ffn_dim_multiplier is not None:
        size = int(c.block_ffn_dim_multiplier * size)
        m = int(c.block_multiple_of)
        size = m * ((size + m - 1) // m)
    return size


def _layer_types(c: Any, arch: str) -> tuple[str, ...]:
    types = c.layer_types
    if types is None:  # Lfm2MoeConfig has no default (its modelling code would fail too)
        raise ConfigError(f"{arch} config.json has no layer_types")
    return map_layer_types(list(types), int(c.num_hidden_layers), _LAYER_TYPES, "LFM2")


def _rope_theta(c: Any) -> float:
    rp = c.rope_parameters or {}
    if rp.get("rope_type", "default") not in ("default", None):
        raise ConfigError(f"rope_type {rp.get('rope_type')!r} is not supported (only 'default')")
    return float(rp["rope_theta"])


def _moe_fields(c: Any, arch: str) -> dict[str, Any]:
    if arch != "lfm2_moe":
        return {"num_dense_layers": int(c.num_hidden_layers)}
    return {
        "num_experts": int(c.num_experts),
        "num_experts_per_tok": int(c.num_experts_per_tok),
        "moe_intermediate_size": int(c.moe_intermediate_size),
        "num_dense_layers": int(c.num_dense_layers),
        "use_expert_bias": bool(c.use_expert_bias),
        "norm_topk_prob": bool(c.norm_topk_prob),
        "routed_scaling_factor": float(c.routed_scaling_factor),
    }


def lfm2_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    c = require_transformers_config("lfm2" if arch == "lfm2" else "lfm2_moe", raw)
    head_dim = head_dim_of(c)
    return {
        "arch": arch,
        "vocab_size": int(c.vocab_size),
        "hidden_size": int(c.hidden_size),
        "num_layers": int(c.num_hidden_layers),
        "layer_types": _layer_types(c, arch),
        "num_heads": int(c.num_attention_heads),
        "num_kv_heads": int(c.num_key_value_heads),
        "head_dim": head_dim,
        "rope_theta": _rope_theta(c),
        "rotary_dim": head_dim,
        "norm_eps": float(c.norm_eps),
        "max_model_len": int(c.max_position_embeddings),
        "intermediate_size": mlp_size(c, arch),
        "tie_word_embeddings": bool(c.tie_word_embeddings),
        "eos_token_ids": eos_ids(c.eos_token_id),
        "bos_token_id": c.bos_token_id,
        "conv_width": int(c.conv_L_cache),
        "conv_bias": bool(c.conv_bias),
        **_moe_fields(c, arch),
    }
