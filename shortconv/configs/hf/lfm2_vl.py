"""LFM2-VL (`Lfm2VlForConditionalGeneration`, model_type "lfm2_vl"): config.json → the LFM2
text fields of our ModelConfig, plus a frozen `VisionConfig` for the encoder and projector.

Read through transformers' `Lfm2VlConfig` (its `text_config` an Lfm2Config, its `vision_config`
a Siglip2VisionConfig). Where the installed transformers has no lfm2_vl (an older pin), the
same fields are read from `fallback_lfm2_vl_config(raw)`: transformers 5.24's defaults, restated.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from shortconv.configs.hf.lfm2 import lfm2_fields
from shortconv.configs.hf.transformers_class import transformers_config
from shortconv.configs.hf.vision_language import vl_text_fields
from shortconv.errors import ConfigError

# transformers 5.24 Lfm2VlConfig and Siglip2VisionConfig defaults, for the fallback only.
_LFM2_VL_DEFAULTS: dict[str, Any] = {
    "image_token_id": 396,
    "projector_hidden_act": "gelu",
    "projector_hidden_size": 2560,
    "projector_bias": True,
    "projector_use_layernorm": True,
    "downsample_factor": 2,
    "tie_word_embeddings": True,
}
_SIGLIP2_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "num_patches": 256,
}
# Activations the encoder and projector implement (shortconv.layers.vision_encoder.activation).
ACTIVATIONS = ("gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class VisionConfig:
    """The SigLIP2 NaFlex encoder and the pixel-unshuffle projector of LFM2-VL."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    num_positions: int  # the learned position grid, (sqrt(n) x sqrt(n)), resized per image
    downsample_factor: int
    projector_hidden_size: int
    projector_bias: bool
    projector_use_layernorm: bool
    projector_hidden_act: str
    image_token_id: int
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Features of one patchified patch as the processor writes it (channels x p x p)."""
        return self.num_channels * self.patch_size**2

    @property
    def position_grid(self) -> int:
        return math.isqrt(self.num_positions)


def fallback_lfm2_vl_config(raw: dict[str, Any]) -> SimpleNamespace:
    """What Lfm2VlConfig (transformers 5.24) resolves for `raw`, for the fields we read."""
    c = SimpleNamespace(**(_LFM2_VL_DEFAULTS | copy.deepcopy(raw)))
    if "tie_embedding" in raw:  # Lfm2VlConfig.__post_init__
        c.tie_word_embeddings = raw["tie_embedding"]
    c.vision_config = SimpleNamespace(
        **(_SIGLIP2_VISION_DEFAULTS | (raw.get("vision_config") or {}))
    )
    c.text_config = dict(raw.get("text_config") or {"model_type": "lfm2"})
    return c


def _hf_config(raw: dict[str, Any]) -> Any:
    """transformers' Lfm2VlConfig for `raw`, else the fallback; text_config as a dict."""
    c = transformers_config("lfm2_vl", raw)
    if c is None:
        return fallback_lfm2_vl_config(raw)
    c.text_config = c.text_config.to_dict()
    return c


def _vision(c: Any) -> VisionConfig:
    v = c.vision_config
    text_hidden = int(c.text_config["hidden_size"])
    return VisionConfig(
        hidden_size=int(v.hidden_size),
        intermediate_size=int(v.intermediate_size),
        num_layers=int(v.num_hidden_layers),
        num_heads=int(v.num_attention_heads),
        num_channels=int(v.num_channels),
        patch_size=int(v.patch_size),
        hidden_act=str(v.hidden_act),
        layer_norm_eps=float(v.layer_norm_eps),
        num_positions=int(v.num_patches),
        downsample_factor=int(c.downsample_factor),
        projector_hidden_size=int(c.projector_hidden_size),
        projector_bias=bool(c.projector_bias),
        projector_use_layernorm=bool(c.projector_use_layernorm),
        projector_hidden_act=str(c.projector_hidden_act),
        image_token_id=int(c.image_token_id),
        text_hidden_size=text_hidden,
    )


def _check_vision(v: VisionConfig, vocab_size: int) -> None:
    """Refuse at start-up what the encoder cannot run, naming the field."""
    for field, act in (
        ("hidden_act", v.hidden_act),
        ("projector_hidden_act", v.projector_hidden_act),
    ):
        if act not in ACTIVATIONS:
            raise ConfigError(f"LFM2-VL {field} {act!r} is not supported; expected {ACTIVATIONS}")
    if v.hidden_size % v.num_heads:
        raise ConfigError(
            f"vision hidden_size ({v.hidden_size}) must be a multiple of num_attention_heads "
            f"({v.num_heads})"
        )
    if v.position_grid**2 != v.num_positions:
        raise ConfigError(f"vision num_patches ({v.num_positions}) must be a square")
    if v.downsample_factor < 1:
        raise ConfigError(f"downsample_factor must be >= 1, got {v.downsample_factor}")
    if not 0 <= v.image_token_id < vocab_size:
        raise ConfigError(f"image_token_id {v.image_token_id} is outside the vocabulary")


def vision_config(raw: dict[str, Any]) -> VisionConfig:
    """The VisionConfig of an LFM2-VL config.json (checked when ModelConfig reads it)."""
    return _vision(_hf_config(raw))


def lfm2_vl_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The text model's ModelConfig fields (LFM2), under `arch`; the vision part is checked."""
    c = _hf_config(raw)
    fields = vl_text_fields(c, arch, "lfm2", lfm2_fields, "LFM2-VL")
    _check_vision(_vision(c), fields["vocab_size"])
    return fields
