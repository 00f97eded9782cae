"""Parse a transformers ZAYA1 (`ZayaForCausalLM`) config.json into our ModelConfig.

Defaults are transformers 5.24's `ZayaConfig` defaults, so a config.json that omits a field
means what it means to the reference.
"""

from __future__ import annotations

from typing import Any

from shortconv.config import ConfigError, ModelConfig
from shortconv.layers.zaya_moe import expert_activation

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

_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5}


def _eos(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id", 106)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _hybrid_rope(raw: dict[str, Any]) -> dict[str, Any]:
    rp = raw.get("rope_parameters")
    # NOTE: some hub configs also carry a top-level "rope_type" next to the per-type dicts.
    hybrid = (rp or {}).get("hybrid") if isinstance(rp, dict) else None
    hybrid = dict(_DEFAULT_ROPE) | dict(hybrid or {})
    if hybrid.get("rope_type", "default") not in ("default", None):
        raise ConfigError(
            f"ZAYA1 rope_type {hybrid.get('rope_type')!r} is not supported (only 'default')"
        )
    return hybrid


def _layer_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    types = raw.get("layer_types") or ["hybrid"] * n
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


def _check_shapes(
    heads: int, kv_heads: int, head_dim: int, rotary_dim: int, t0: int, t1: int
) -> None:
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
    if t0 < 1 or t1 < 1:
        raise ConfigError(f"cca_time0/cca_time1 must be >= 1, got {t0}/{t1}")


def parse_zaya_config(raw: dict[str, Any], arch: str) -> ModelConfig:
    """config.json (transformers ZAYA layout) → ModelConfig; refuses what we cannot serve."""
    legacy = [k for k in LEGACY_CONFIG_KEYS if k in raw]
    if legacy:
        raise ConfigError(
            f"config.json is in the original Zyphra ZAYA format (fields {legacy}); "
            + CONVERTER_HINT
        )
    n = int(raw.get("num_hidden_layers", 40))
    heads, kv_heads = int(raw.get("num_attention_heads", 8)), int(raw.get("num_key_value_heads", 2))
    head_dim = int(raw.get("head_dim") or 128)
    rope = _hybrid_rope(raw)
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    t0, t1 = int(raw.get("cca_time0", 2)), int(raw.get("cca_time1", 2))
    _check_shapes(heads, kv_heads, head_dim, rotary_dim, t0, t1)
    top_k = int(raw.get("num_experts_per_tok", 1))
    if top_k != 1:
        raise ConfigError(f"ZAYA1 supports num_experts_per_tok = 1 only, got {top_k}")
    moe_inter = int(raw.get("moe_intermediate_size", 2048))
    hidden_act = str(raw.get("hidden_act", "silu"))
    expert_activation(hidden_act)  # refuse an unknown activation at start-up
    return ModelConfig(
        arch=arch,
        vocab_size=int(raw.get("vocab_size", 262272)),
        hidden_size=int(raw.get("hidden_size", 2048)),
        num_layers=n,
        layer_types=_layer_types(raw, n),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(rope["rope_theta"]),
        rotary_dim=rotary_dim,
        norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_model_len=int(raw.get("max_position_embeddings", 131072)),
        intermediate_size=moe_inter,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        eos_token_ids=_eos(raw),
        bos_token_id=raw.get("bos_token_id", 2),
        num_experts=int(raw.get("num_experts", 16)),
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        num_dense_layers=0,
        cca_time0=t0,
        cca_time1=t1,
        router_hidden_size=int(raw.get("router_hidden_size", 256)),
        attention_bias=bool(raw.get("attention_bias", False)),
        lm_head_bias=bool(raw.get("lm_head_bias", False)),
        hidden_act=hidden_act,
        raw=raw,
    )
