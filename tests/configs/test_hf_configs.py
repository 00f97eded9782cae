"""config.json is read through transformers' config classes: each case below is one where the
old hand parse resolved a field differently from transformers (or refused what it accepts)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shortconv.configs.config import ModelConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.configs.hf.zaya1 import fallback_zaya_config, zaya1_fields
from shortconv.errors import ConfigError
from shortconv.tiny.checkpoint import TINY_PRESETS

MODEL_TYPES = {"lfm2": "lfm2", "lfm2_moe": "lfm2_moe", "zaya1": "zaya"}


def tiny(arch: str, **changes: Any) -> dict[str, Any]:
    raw = {**TINY_PRESETS[arch], "model_type": MODEL_TYPES[arch], **changes}
    return {k: v for k, v in raw.items() if v is not _DROP}


_DROP = object()


def hf_config(raw: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    raw = dict(raw)
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


@pytest.mark.parametrize("arch", ["lfm2", "lfm2_moe"])
@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"tie_embedding": False, "tie_word_embeddings": True}, False),
        ({"tie_embedding": True, "tie_word_embeddings": False}, True),
        ({"tie_embedding": False, "tie_word_embeddings": _DROP}, False),
        ({"tie_word_embeddings": False}, False),
    ],
)
def test_tie_embedding_overrides_tie_word_embeddings(arch, keys, expected) -> None:
    """transformers' Lfm2Config/Lfm2MoeConfig let the legacy `tie_embedding` win; the old
    parse read `tie_word_embeddings` first."""
    raw = tiny(arch, **keys)
    assert ModelConfig.from_hf_dict(raw).tie_word_embeddings is expected
    assert hf_config(raw).tie_word_embeddings is expected


def test_lfm2_moe_ignores_block_ff_dim() -> None:
    """Only Lfm2Config maps `block_ff_dim` onto intermediate_size; the old parse applied it to
    LFM2-MoE's dense layers as well."""
    raw = tiny("lfm2_moe", block_ff_dim=96)
    assert (
        ModelConfig.from_hf_dict(raw).intermediate_size == 128 == hf_config(raw).intermediate_size
    )
    lfm2 = tiny("lfm2", block_ff_dim=96)
    assert ModelConfig.from_hf_dict(lfm2).intermediate_size == 96


def test_lfm2_moe_dense_mlp_width_is_what_transformers_builds() -> None:
    """LFM2-MoE never auto-adjusts its dense MLP, even with LFM2's keys present as extras."""
    from transformers import AutoModelForCausalLM

    raw = tiny("lfm2_moe", block_auto_adjust_ff_dim=True, intermediate_size=300)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config(raw))
    width = hf.model.layers[0].feed_forward.w1.weight.shape[0]
    assert ModelConfig.from_hf_dict(raw).intermediate_size == width == 300


def test_absent_token_ids_take_the_class_defaults() -> None:
    """The old parse left eos empty and bos None; Lfm2Config defaults them to 2 and 1."""
    raw = tiny("lfm2", eos_token_id=_DROP, bos_token_id=_DROP)
    cfg = ModelConfig.from_hf_dict(raw)
    assert (cfg.eos_token_ids, cfg.bos_token_id) == ((2,), 1)


def test_absent_lfm2_fields_take_the_class_defaults() -> None:
    """The old parse refused a config.json without num_key_value_heads ("lacks required
    field"); Lfm2Config's default is 8."""
    raw = tiny("lfm2", num_key_value_heads=_DROP, num_attention_heads=8)
    assert ModelConfig.from_hf_dict(raw).num_kv_heads == 8 == hf_config(raw).num_key_value_heads


def test_absent_lfm2_moe_fields_take_the_class_defaults() -> None:
    """The old parse read absent MoE fields as 0/False (no experts, no expert bias, every layer
    dense); Lfm2MoeConfig's defaults are 32 experts, top-4, 1792 wide, 2 dense layers, bias on."""
    drop = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_dense_layers")
    raw = tiny("lfm2_moe", use_expert_bias=_DROP, **dict.fromkeys(drop, _DROP))
    cfg = ModelConfig.from_hf_dict(raw)
    got = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size)
    assert got == (32, 4, 1792)
    assert (cfg.num_dense_layers, cfg.use_expert_bias) == (2, True)


def test_lfm2_full_attn_idxs_alias_is_lfm2_only() -> None:
    """Lfm2Config derives layer_types from the legacy `full_attn_idxs`; Lfm2MoeConfig does not
    (its model cannot be built without layer_types), which the old parse accepted anyway."""
    cfg = ModelConfig.from_hf_dict(tiny("lfm2", layer_types=_DROP, full_attn_idxs=[1, 4]))
    assert cfg.attention_layer_ids == (1, 4) and len(cfg.layer_types) == 6
    with pytest.raises(ConfigError, match="lfm2_moe config.json has no layer_types"):
        ModelConfig.from_hf_dict(tiny("lfm2_moe", layer_types=_DROP, full_attn_idxs=[1, 3]))


def test_legacy_top_level_rope_theta() -> None:
    raw = tiny("lfm2", rope_theta=12345.0)
    assert ModelConfig.from_hf_dict(raw).rope_theta == 12345.0
    assert hf_config(raw).rope_parameters["rope_theta"] == 12345.0


def test_unsupported_values_keep_clear_errors() -> None:
    with pytest.raises(ConfigError, match="rope_type 'linear' is not supported"):
        ModelConfig.from_hf_dict(tiny("lfm2", rope_scaling={"rope_type": "linear", "factor": 2}))
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf_dict(tiny("lfm2", layer_types=["conv", "full_attention"]))
    with pytest.raises(ConfigError, match="hidden_size"):  # a type transformers refuses
        ModelConfig.from_hf_dict(tiny("lfm2", hidden_size="64"))


def test_zaya_hybrid_rope_without_partial_factor_is_full_rotary() -> None:
    """An explicit `rope_parameters.hybrid` without `partial_rotary_factor` rotates the whole
    head in ZayaRotaryEmbedding (factor 1.0); the old parse merged in the 0.5 default."""
    rope = {"hybrid": {"rope_type": "default", "rope_theta": 10_000.0}}
    cfg = ModelConfig.from_hf_dict(tiny("zaya1", rope_parameters=rope))
    assert (cfg.rotary_dim, cfg.rope_theta) == (16, 10_000.0)
    if transformers_lacks("zaya") is None:
        from transformers.models.zaya.modeling_zaya import ZayaRotaryEmbedding

        inv_freq = ZayaRotaryEmbedding(
            hf_config(tiny("zaya1", rope_parameters=rope))
        ).hybrid_inv_freq
        assert 2 * inv_freq.numel() == cfg.rotary_dim


ZAYA_VARIANTS = [
    {},
    {"rope_parameters": {"rope_type": "default", "hybrid": {"rope_theta": 1e6}}},
    {"rope_theta": 7.0},  # a stray legacy key: ZayaConfig keeps the default hybrid rope
    {"eos_token_id": [1, 106], "head_dim": 32, "tie_word_embeddings": False},
]


@pytest.mark.parametrize("changes", ZAYA_VARIANTS)
def test_zaya_fallback_reads_configs_as_transformers_does(changes, monkeypatch) -> None:
    """Where transformers has no ZayaConfig (the GPU machine's 5.17), the fallback gives the
    same ModelConfig as ZayaConfig does."""
    if transformers_lacks("zaya") is not None:
        pytest.skip(transformers_lacks("zaya"))
    raw = tiny("zaya1", **changes)
    with_hf = zaya1_fields(raw, "zaya1")
    monkeypatch.setattr(
        "shortconv.configs.hf.zaya1.transformers_config", lambda model_type, raw: None
    )
    assert zaya1_fields(raw, "zaya1") == with_hf
    assert fallback_zaya_config(raw).rope_parameters == hf_config(raw).rope_parameters


def test_config_parsing_imports_no_model_code() -> None:
    """config → hf_configs never reaches the model registry, models or layers (no import cycle)."""
    import subprocess
    import sys

    code = (
        "import sys; from shortconv.configs.config import ModelConfig; "
        "ModelConfig.from_hf_dict({'model_type': 'lfm2'}); "
        "bad = [m for m in sys.modules if m.startswith(('shortconv.models', 'shortconv.layers'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(_root()))


def _root() -> Any:
    from pathlib import Path

    return Path(__file__).resolve().parents[2]
