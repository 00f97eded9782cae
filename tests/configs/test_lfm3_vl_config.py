"""LFM3-VL's config.json is read through Lfm3VlConfig, or where transformers lacks it through
a fallback that must resolve every field we read the same way; what we cannot run is refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from shortconv.configs.config import ModelConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.configs.hf.lfm3 import lfm3_fields
from shortconv.configs.hf.lfm3_vl import lfm3_vl_fields, vision_config
from shortconv.configs.support import check_support
from shortconv.errors import ConfigError
from shortconv.tiny.checkpoint import TINY_PRESETS
from shortconv.tiny.lfm3_vl import IMAGE_TOKEN_ID, VISION_PRESET

CPU = torch.device("cpu")


def tiny(**changes: Any) -> dict[str, Any]:
    raw = {
        "architectures": ["Lfm3VlForConditionalGeneration"],
        "model_type": "lfm3_vl",
        "text_config": {**TINY_PRESETS["lfm3"], "model_type": "lfm3"},
        "vision_config": {**VISION_PRESET, "model_type": "lfm3_vl_vision"},
        "image_token_id": IMAGE_TOKEN_ID,
        "projector_hidden_size": 48,
    }
    return {k: v for k, v in (raw | changes).items() if v is not None}  # None: key absent


def vision(**changes: Any) -> dict[str, Any]:
    return {**VISION_PRESET, "model_type": "lfm3_vl_vision", **changes}


VARIANTS: list[dict[str, Any]] = [
    {},
    {"vision_config": None, "projector_hidden_size": None},  # every vision default
    {"tie_word_embeddings": False, "projector_bias": False, "projector_hidden_act": "gelu"},
    {"vision_config": vision(layer_types=None, num_hidden_layers=5)},  # the default pattern
    {"vision_config": vision(rope_parameters=None, norm_eps=1e-6, conv_kernel_size=5)},
    {"vision_config": vision(spatial_merge_size=1, temporal_patch_size=1, patch_size=[4, 4])},
    {"text_config": {"model_type": "lfm3", "vocab_size": 1024, "hidden_size": 128}},
]


@pytest.mark.parametrize("changes", VARIANTS)
def test_fallback_reads_configs_as_lfm3vlconfig_does(changes, monkeypatch) -> None:
    if reason := transformers_lacks("lfm3_vl"):
        pytest.skip(reason)
    raw = tiny(**changes)
    fields, vis = lfm3_vl_fields(raw, "lfm3_vl"), vision_config(raw)
    monkeypatch.setattr("shortconv.configs.hf.lfm3_vl.transformers_config", lambda _t, _r: None)
    assert lfm3_vl_fields(raw, "lfm3_vl") == fields
    assert vision_config(raw) == vis


def test_text_part_is_lfm3() -> None:
    raw = tiny(tie_word_embeddings=False)
    cfg = ModelConfig.from_hf_dict(raw)
    text = lfm3_fields(raw["text_config"], "lfm3")
    assert cfg.arch == "lfm3_vl" and not cfg.tie_word_embeddings
    assert replace(cfg, arch="lfm3", tie_word_embeddings=True) == ModelConfig(**text, raw=raw)
    v = vision_config(raw)
    assert (v.hidden_size, v.layer_types, v.patch_dim, v.merge) == (
        32,
        ("conv", "full_attention", "conv"),
        3 * 2 * 4 * 4,
        2,
    )
    assert (v.num_heads, v.num_kv_heads, v.rope_theta) == (4, 2, 10_000.0)
    assert v.text_hidden_size == cfg.hidden_size and v.image_token_id == IMAGE_TOKEN_ID


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"projector_hidden_act": "relu"}, "projector_hidden_act 'relu' is not supported"),
        ({"vision_config": vision(layer_types=["conv", "mamba", "conv"])}, "layer_types"),
        ({"vision_config": vision(num_key_value_heads=3)}, "KV heads"),
        ({"vision_config": vision(conv_kernel_size=4)}, "odd conv_kernel_size"),
        ({"image_token_id": 4096}, "image_token_id 4096 is outside the vocabulary"),
        ({"text_config": {"model_type": "lfm2"}}, "'lfm2' text model is not supported"),
    ],
)
def test_refused_with_a_clear_message(changes, match) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(tiny(**changes))


def test_support_registry() -> None:
    cfg = ModelConfig.from_hf_dict(tiny())
    check_support(cfg, CPU, 1)
    check_support(cfg, CPU, 2)  # the encoder runs replicated on every rank
    with pytest.raises(ConfigError, match="tp_size=3"):
        check_support(cfg, CPU, 3)  # LFM3's heads and widths still have to split
