"""Architecture registry: parse config.json per architecture and pick the model class."""

from __future__ import annotations

from typing import Any

from shortconv.config import ConfigError, ModelConfig, resolve_arch


def _eos(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope(raw: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    rp = raw.get("rope_parameters") or {}
    if key is not None:
        rp = rp.get(key) or {}
    if rp.get("rope_type", "default") not in ("default", None):
        raise ConfigError(f"rope_type {rp.get('rope_type')!r} is not supported (only 'default')")
    return rp


def _lfm2_ffn_size(raw: dict[str, Any]) -> int:
    size = int(raw.get("block_ff_dim", raw.get("intermediate_size")))
    if raw.get("model_type") == "lfm2" and raw.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        mult = raw.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            size = int(mult * size)
            m = int(raw.get("block_multiple_of", 256))
            size = m * ((size + m - 1) // m)
    return size


def _parse_lfm2(raw: dict[str, Any], arch: str) -> ModelConfig:
    n = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        attn = set(raw.get("full_attn_idxs") or range(n))
        types = ["full_attention" if i in attn else "conv" for i in range(n)]
    layer_types = tuple("attention" if t == "full_attention" else "conv" for t in types)
    if any(t not in ("full_attention", "conv") for t in types):
        raise ConfigError(f"unknown LFM2 layer types in {types}")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    rp = _rope(raw)
    theta = float(rp.get("rope_theta", raw.get("rope_theta", 1_000_000.0)))
    return ModelConfig(
        arch=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=n,
        layer_types=layer_types,
        num_heads=heads,
        num_kv_heads=int(raw["num_key_value_heads"]),
        head_dim=head_dim,
        rope_theta=theta,
        rotary_dim=head_dim,
        norm_eps=float(raw.get("norm_eps", 1e-5)),
        max_model_len=int(raw.get("max_position_embeddings", 128_000)),
        intermediate_size=_lfm2_ffn_size(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", raw.get("tie_embedding", True))),
        eos_token_ids=_eos(raw),
        bos_token_id=raw.get("bos_token_id"),
        conv_width=int(raw.get("conv_L_cache", 3)),
        conv_bias=bool(raw.get("conv_bias", False)),
        num_experts=int(raw.get("num_experts", 0)) if arch == "lfm2_moe" else 0,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)) if arch == "lfm2_moe" else 0,
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
        num_dense_layers=int(raw.get("num_dense_layers", 0)) if arch == "lfm2_moe" else n,
        use_expert_bias=bool(raw.get("use_expert_bias", False)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0) or 1.0),
        raw=raw,
    )


def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    arch = resolve_arch(raw)
    try:
        if arch in ("lfm2", "lfm2_moe"):
            return _parse_lfm2(raw, arch)
        from shortconv.models.zaya1 import parse_zaya_config

        return parse_zaya_config(raw, arch)
    except KeyError as exc:
        raise ConfigError(f"config.json lacks required field {exc} for {arch}") from exc


def model_class(arch: str) -> type:
    if arch in ("lfm2", "lfm2_moe"):
        from shortconv.models.lfm2 import Lfm2ForCausalLM

        return Lfm2ForCausalLM
    if arch == "zaya1":
        from shortconv.models.zaya1 import ZayaForCausalLM

        return ZayaForCausalLM
    raise ConfigError(f"no model class for arch {arch!r}")
