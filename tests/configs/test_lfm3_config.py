"""LFM3's config.json is read through Lfm3Config, or where transformers lacks it (the GPU
machine's 5.17) through a fallback that must resolve every field we read the same way."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shortconv.configs.config import ModelConfig, RopeSpec
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.configs.hf.lfm3 import default_layer_types, fallback_lfm3_config, lfm3_fields
from shortconv.configs.support import check_support
from shortconv.errors import ConfigError
from shortconv.tiny.checkpoint import TINY_PRESETS

CPU = torch.device("cpu")


def tiny(**changes: Any) -> dict[str, Any]:
    return {**TINY_PRESETS["lfm3"], "model_type": "lfm3", **changes}


def released(**changes: Any) -> dict[str, Any]:
    """Every field at Lfm3Config's defaults (the released 1.7B shape)."""
    return {"architectures": ["Lfm3ForCausalLM"], "model_type": "lfm3", **changes}


def _needs_lfm3() -> None:
    if reason := transformers_lacks("lfm3"):
        pytest.skip(reason)


VARIANTS: list[dict[str, Any]] = [
    {},
    {"layer_types": None, "num_hidden_layers": 9},  # Lfm3Config's default pattern
    {"rope_theta": 5.0, "partial_rotary_factor": 0.25},  # stray legacy keys: default rope kept
    {
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.75},
            "sliding_attention": {"rope_theta": 500.0},
        },
        "rope_theta": 7.0,  # fills the full entry's missing theta
    },
    {  # the legacy name, with `type` for rope_type, and no theta anywhere (default_theta)
        "rope_scaling": {
            "full_attention": {"type": "proportional", "partial_rotary_factor": 0.5},
            "sliding_attention": {"type": "default", "rope_theta": 123.0},
        }
    },
    {"rms_norm_eps": 1e-3, "eos_token_id": [2, 5], "tie_word_embeddings": False},
    {"use_sandwich_norm": False, "use_attention_gate": False, "conv_bias": True},
    {"conv_L_cache": 4, "sliding_window": 3, "attention_bias": True},
    {"layer_types": ["conv", "full_attention", "conv", "conv", "full_attention", "conv"]},
]


@pytest.mark.parametrize("changes", VARIANTS)
def test_fallback_reads_configs_as_lfm3config_does(changes, monkeypatch) -> None:
    _needs_lfm3()
    raw = {k: v for k, v in tiny(**changes).items() if v is not None}  # None: key absent
    with_hf = lfm3_fields(raw, "lfm3")
    monkeypatch.setattr("shortconv.configs.hf.lfm3.transformers_config", lambda _t, _r: None)
    assert lfm3_fields(raw, "lfm3") == with_hf
    from transformers import Lfm3Config

    hf = Lfm3Config.from_dict(dict(raw))
    fb = fallback_lfm3_config(raw)
    assert fb.rope_parameters == hf.rope_parameters
    assert fb.layer_types == hf.layer_types and fb.norm_eps == hf.norm_eps


def test_released_defaults(monkeypatch) -> None:
    """The facts of issue #24, from an (almost) empty config.json, with and without Lfm3Config."""
    for _ in range(2):
        cfg = ModelConfig.from_hf_dict(released())
        assert cfg.arch == "lfm3" and cfg.conv_width == 7 and cfg.sliding_window == 256
        assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
            16,
            4,
            128,
            128000,
        )
        assert cfg.rope_of("attention") == RopeSpec(1e6, 64, proportional=True)
        assert cfg.rope_of("sliding_attention") == RopeSpec(1e4, 128)
        assert cfg.intermediate_size == 7680 and cfg.attention_gate and cfg.sandwich_norm
        expected = default_layer_types(24)
        assert cfg.layer_types[2] == "attention" and cfg.layer_types[4] == "sliding_attention"
        assert [t.replace("full_", "") for t in expected] == list(cfg.layer_types)
        monkeypatch.setattr("shortconv.configs.hf.lfm3.transformers_config", lambda _t, _r: None)


def test_default_layer_types_match_lfm3config() -> None:
    _needs_lfm3()
    from transformers import Lfm3Config

    for n in (1, 5, 24):
        assert default_layer_types(n) == Lfm3Config(num_hidden_layers=n).layer_types


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0},
                    "sliding_attention": {"rope_theta": 1e4},
                }
            },
            "rope_type 'yarn' is not supported",
        ),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "proportional", "factor": 2.0},
                    "sliding_attention": {"rope_theta": 1e4},
                }
            },
            "factor != 1",
        ),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "keyed by type"),
        ({"sliding_window": None}, "sliding_window = None"),
        ({"layer_types": ["conv"] * 5 + ["mamba"]}, "unknown LFM3 layer types"),
        ({"layer_types": ["conv"] * 5}, "layer_types"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ],
)
def test_refused_with_a_clear_message(changes, match, monkeypatch) -> None:
    raw = tiny(**changes)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(raw)
    monkeypatch.setattr("shortconv.configs.hf.lfm3.transformers_config", lambda _t, _r: None)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_released_shape_splits_at_tp(tp: int) -> None:
    """16 q / 4 KV heads: tp 2 and 4 shard the KV heads, tp 8 replicates them."""
    check_support(ModelConfig.from_hf_dict(released()), CPU, tp)


@pytest.mark.parametrize(
    ("tp", "changes", "what"),
    [
        (3, {}, "attention heads"),
        (4, {"hidden_size": 66}, "conv channels"),
        (2, {"intermediate_size": 129}, "intermediate_size"),
        (2, {"vocab_size": 511}, "vocab_size"),
    ],
)
def test_tp_that_does_not_divide_is_refused(tp: int, changes: dict, what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        check_support(ModelConfig.from_hf_dict(tiny(**changes)), CPU, tp)


def test_conv_wider_than_the_triton_kernels_is_refused_at_start(monkeypatch) -> None:
    """A width past the Triton kernels' bound fails at start-up on their path (CUDA, or forced
    on CPU), not at the first prefill; the torch path takes any width."""
    wide = ModelConfig.from_hf_dict(tiny(conv_L_cache=9))
    monkeypatch.delenv("SHORTCONV_KERNELS", raising=False)
    check_support(wide, CPU, 1)
    with pytest.raises(ConfigError, match=r"width 9 .*2\.\.8"):
        check_support(wide, torch.device("cuda"), 1)
    monkeypatch.setenv("SHORTCONV_KERNELS", "triton")
    with pytest.raises(ConfigError, match="width 9"):
        check_support(wide, CPU, 1)
    check_support(ModelConfig.from_hf_dict(tiny(conv_L_cache=8)), CPU, 1)
    monkeypatch.setenv("SHORTCONV_KERNELS", "torch")
    check_support(wide, torch.device("cuda"), 1)
