"""LFM2-VL's config.json is read through Lfm2VlConfig, or where transformers lacks it through
a fallback that must resolve every field we read the same way; what we cannot run is refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from shortconv.configs.config import ModelConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.configs.hf.lfm2 import lfm2_fields
from shortconv.configs.hf.lfm2_vl import lfm2_vl_fields, vision_config
from shortconv.configs.support import check_support
from shortconv.errors import ConfigError
from shortconv.tiny.checkpoint import TINY_PRESETS
from shortconv.tiny.vision import IMAGE_TOKEN_ID, VISION_PRESET

CPU = torch.device("cpu")


def tiny(**changes: Any) -> dict[str, Any]:
    raw = {
        "architectures": ["Lfm2VlForConditionalGeneration"],
        "model_type": "lfm2_vl",
        "text_config": {**TINY_PRESETS["lfm2"], "model_type": "lfm2"},
        "vision_config": {**VISION_PRESET, "model_type": "siglip2_vision_model"},
        "image_token_id": IMAGE_TOKEN_ID,
        "projector_hidden_size": 48,
    }
    return {k: v for k, v in (raw | changes).items() if v is not None}  # None: key absent


VARIANTS: list[dict[str, Any]] = [
    {},
    {"vision_config": None, "projector_hidden_size": None},  # every vision default
    {"tie_embedding": False},  # the legacy key Lfm2VlConfig reads
    {"tie_word_embeddings": False, "downsample_factor": 4, "projector_bias": False},
    {"projector_use_layernorm": False, "projector_hidden_act": "gelu_pytorch_tanh"},
    {"vision_config": {**VISION_PRESET, "hidden_act": "gelu", "layer_norm_eps": 1e-5}},
    {"text_config": {"model_type": "lfm2", "vocab_size": 1024, "hidden_size": 128}},
]


@pytest.mark.parametrize("changes", VARIANTS)
def test_fallback_reads_configs_as_lfm2vlconfig_does(changes, monkeypatch) -> None:
    if reason := transformers_lacks("lfm2_vl"):
        pytest.skip(reason)
    raw = tiny(**changes)
    fields, vision = lfm2_vl_fields(raw, "lfm2_vl"), vision_config(raw)
    monkeypatch.setattr("shortconv.configs.hf.lfm2_vl.transformers_config", lambda _t, _r: None)
    assert lfm2_vl_fields(raw, "lfm2_vl") == fields
    assert vision_config(raw) == vision


def test_text_part_is_lfm2() -> None:
    raw = tiny(tie_word_embeddings=False)
    cfg = ModelConfig.from_hf_dict(raw)
    text = lfm2_fields(raw["text_config"], "lfm2")
    assert cfg.arch == "lfm2_vl" and not cfg.tie_word_embeddings
    assert replace(cfg, arch="lfm2", tie_word_embeddings=True) == ModelConfig(**text, raw=raw)
    v = vision_config(raw)
    assert (v.hidden_size, v.num_layers, v.patch_dim, v.position_grid) == (32, 2, 48, 4)
    assert v.text_hidden_size == cfg.hidden_size and v.image_token_id == IMAGE_TOKEN_ID


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"projector_hidden_act": "relu"}, "projector_hidden_act 'relu' is not supported"),
        ({"vision_config": {**VISION_PRESET, "hidden_act": "silu"}}, "hidden_act 'silu'"),
        ({"vision_config": {**VISION_PRESET, "num_patches": 15}}, "must be a square"),
        ({"image_token_id": 4096}, "image_token_id 4096 is outside the vocabulary"),
        ({"text_config": {"model_type": "lfm2_moe"}}, "'lfm2_moe' text model is not supported"),
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
        check_support(cfg, CPU, 3)  # LFM2's heads and widths still have to split
