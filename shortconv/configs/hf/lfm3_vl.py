"""LFM3-VL (`Lfm3VlForConditionalGeneration`, model_type "lfm3_vl"): config.json → the LFM3 text
fields of our ModelConfig, plus a frozen `Lfm3VisionConfig` for the encoder and projector.

Read through transformers' `Lfm3VlConfig` (its `text_config` an Lfm3Config, its `vision_config`
an Lfm3VlVisionConfig). Where the installed transformers has no lfm3_vl (the GPU machine's
5.17), the same fields are read from `fallback_lfm3_vl_config(raw)`: transformers 5.24's
defaults, restated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from shortconv.configs.hf.lfm3 import lfm3_fields
from shortconv.configs.hf.transformers_class import transformers_config
from shortconv.configs.hf.vision_language import vl_text_fields
from shortconv.errors import ConfigError

# transformers 5.24 Lfm3VlConfig and Lfm3VlVisionConfig defaults, for the fallback only.
_LFM3_VL_DEFAULTS: dict[str, Any] = {
    "image_token_id": 125_030,
    "video_token_id": 125_029,
    "projector_hidden_act": "gelu",
    "projector_hidden_size": 4096,
    "projector_bias": True,
    "tie_word_embeddings": True,
}
_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2560,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_hidden_layers": 14,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "layer_types": None,
    "conv_kernel_size": 3,
    "norm_eps": 1e-5,
    "rope_parameters": None,
}
_DEFAULT_VISION_THETA = 1_000_000.0  # Lfm3VlVisionConfig.default_theta
VISION_LAYER_TYPES = ("conv", "full_attention")
# The projector's activations (shortconv.layers.vision_encoder.activation).
ACTIVATIONS = ("gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Lfm3VisionConfig:
    """The LFM3-VL encoder (gated 2D short convs and axial-RoPE attention over each image's
    patch grid) and its projector (LayerNorm, merge of `merge` x `merge` patches, two Linears)."""

    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    patch_dim: int  # one patch as the processor writes it: channels x temporal x p x p
    merge: int  # spatial_merge_size: merge x merge patches make one image token
    conv_kernel_size: int
    norm_eps: float
    rope_theta: float
    projector_hidden_size: int
    projector_bias: bool
    projector_hidden_act: str
    image_token_id: int
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def default_vision_layer_types(n: int) -> list[str]:
    """Lfm3VlVisionConfig's pattern: conv for the first two layers and every odd one."""
    return ["conv" if i < 2 or i % 2 else "full_attention" for i in range(n)]


def fallback_lfm3_vl_config(raw: dict[str, Any]) -> SimpleNamespace:
    """What Lfm3VlConfig (transformers 5.24) resolves for `raw`, for the fields we read."""
    c = SimpleNamespace(**(_LFM3_VL_DEFAULTS | copy.deepcopy(raw)))
    v = SimpleNamespace(**(_VISION_DEFAULTS | (raw.get("vision_config") or {})))
    if v.layer_types is None:
        v.layer_types = default_vision_layer_types(int(v.num_hidden_layers))
    rope = dict(v.rope_parameters or {})
    rope.setdefault("rope_type", "axial")
    theta = (raw.get("vision_config") or {}).get("rope_theta", _DEFAULT_VISION_THETA)
    rope.setdefault("rope_theta", theta)
    v.rope_parameters = rope
    c.vision_config = v
    c.text_config = dict(raw.get("text_config") or {"model_type": "lfm3"})
    return c


def _hf_config(raw: dict[str, Any]) -> Any:
    """transformers' Lfm3VlConfig for `raw`, else the fallback; text_config as a dict."""
    c = transformers_config("lfm3_vl", raw)
    if c is None:
        return fallback_lfm3_vl_config(raw)
    c.text_config = c.text_config.to_dict()
    return c


def _single(value: Any, what: str) -> int:
    """patch sizes may be written as a pair; the encoder takes square ones."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigError(f"LFM3-VL vision {what} {list(value)} is not supported (not square)")
        value = value[0]
    return int(value)


def _vision(c: Any) -> Lfm3VisionConfig:
    v = c.vision_config
    patch, temporal = _single(v.patch_size, "patch_size"), _single(v.temporal_patch_size, "tps")
    return Lfm3VisionConfig(
        hidden_size=int(v.hidden_size),
        intermediate_size=int(v.intermediate_size),
        layer_types=tuple(v.layer_types),
        num_heads=int(v.num_attention_heads),
        num_kv_heads=int(v.num_key_value_heads),
        patch_dim=int(v.in_channels) * temporal * patch * patch,
        merge=int(v.spatial_merge_size),
        conv_kernel_size=int(v.conv_kernel_size),
        norm_eps=float(v.norm_eps),
        rope_theta=float((v.rope_parameters or {}).get("rope_theta", _DEFAULT_VISION_THETA)),
        projector_hidden_size=int(c.projector_hidden_size),
        projector_bias=bool(c.projector_bias),
        projector_hidden_act=str(c.projector_hidden_act),
        image_token_id=int(c.image_token_id),
        text_hidden_size=int(c.text_config["hidden_size"]),
    )


def _check_vision(c: Any, v: Lfm3VisionConfig, vocab_size: int) -> None:
    """Refuse at start-up what the encoder cannot run, naming the field."""
    rope_type = (c.vision_config.rope_parameters or {}).get("rope_type", "axial")
    if rope_type != "axial":
        raise ConfigError(f"LFM3-VL vision rope_type {rope_type!r} is not supported (only axial)")
    unknown = sorted(set(v.layer_types) - set(VISION_LAYER_TYPES))
    if unknown or len(v.layer_types) != int(c.vision_config.num_hidden_layers):
        raise ConfigError(
            f"LFM3-VL vision layer_types {list(v.layer_types)} must name one of "
            f"{VISION_LAYER_TYPES} per layer"
        )
    if v.projector_hidden_act not in ACTIVATIONS:
        raise ConfigError(
            f"LFM3-VL projector_hidden_act {v.projector_hidden_act!r} is not supported; "
            f"expected {ACTIVATIONS}"
        )
    if v.hidden_size % v.num_heads or v.num_heads % v.num_kv_heads or v.head_dim % 4:
        raise ConfigError(
            f"LFM3-VL vision heads: hidden_size {v.hidden_size}, {v.num_heads} heads, "
            f"{v.num_kv_heads} KV heads (axial RoPE needs a head_dim divisible by 4)"
        )
    if v.merge < 1 or v.conv_kernel_size % 2 == 0:
        raise ConfigError("LFM3-VL needs spatial_merge_size >= 1 and an odd conv_kernel_size")
    if not 0 <= v.image_token_id < vocab_size:
        raise ConfigError(f"image_token_id {v.image_token_id} is outside the vocabulary")


def vision_config(raw: dict[str, Any]) -> Lfm3VisionConfig:
    """The Lfm3VisionConfig of an LFM3-VL config.json (checked when ModelConfig reads it)."""
    return _vision(_hf_config(raw))


def lfm3_vl_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The text model's ModelConfig fields (LFM3), under `arch`; the vision part is checked."""
    c = _hf_config(raw)
    fields = vl_text_fields(c, arch, "lfm3", lfm3_fields, "LFM3-VL")
    _check_vision(c, _vision(c), fields["vocab_size"])
    return fields
