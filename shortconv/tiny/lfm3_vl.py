"""A tiny random LFM3-VL checkpoint with its processor, for `model: null` and the parity tests.

    python -m shortconv.tiny.checkpoint --arch lfm3_vl --out DIR [--seed N]

Beside the weights it saves what transformers' `Lfm3VlProcessor` reads
(`shortconv.configs.hf.processors.load_processor`): the Qwen2-VL image processor's config,
sized so a tiny image makes a few tokens (4-pixel patches merged 2 x 2, so 8 pixels a token
side; 4 to 16 tokens an image), and the byte-level tokenizer with the vision tokens as named
specials and a ChatML template whose content parts may be images.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shortconv.engine import tokenizer as toks
from shortconv.tiny.presets import TINY_PRESETS, TOKEN_IDS
from shortconv.tiny.rerandomize import random_vl_model
from shortconv.tiny.templates import LFM2_TOOL_TOKENS, LFM3_VL_CHAT_TEMPLATE

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
# Named specials follow the 4 specials and 256 bytes, the tool markers first.
IMAGE_TOKEN_ID = toks.BYTE_TOKEN_OFFSET + toks.NUM_BYTE_TOKENS + len(LFM2_TOOL_TOKENS)
PATCH, MERGE = 4, 2
TOKEN_PIXELS = PATCH * MERGE  # one image token covers TOKEN_PIXELS x TOKEN_PIXELS pixels

VISION_PRESET: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query, as the real encoder
    "patch_size": PATCH,
    "spatial_merge_size": MERGE,
    "layer_types": ["conv", "full_attention", "conv"],
    "rope_parameters": {"rope_type": "axial", "rope_theta": 10_000.0},
}
IMAGE_PROCESSOR: dict[str, Any] = {
    "patch_size": PATCH,
    "temporal_patch_size": 2,
    "merge_size": MERGE,
    "min_pixels": 4 * TOKEN_PIXELS**2,
    "max_pixels": 16 * TOKEN_PIXELS**2,
}


def lfm3_vl_config(overrides: dict[str, Any] | None = None) -> Any:
    """The tiny `Lfm3VlConfig`: the tiny LFM3 as its text model."""
    from transformers import Lfm3VlConfig

    kwargs: dict[str, Any] = {
        "text_config": dict(TINY_PRESETS["lfm3"], model_type="lfm3"),
        "vision_config": dict(VISION_PRESET),
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": IMAGE_TOKEN_ID + 1,
        "vision_start_token_id": IMAGE_TOKEN_ID + 2,
        "vision_end_token_id": IMAGE_TOKEN_ID + 3,
        "projector_hidden_size": 48,
        "tie_word_embeddings": True,
        **TOKEN_IDS,
    }
    kwargs.update(overrides or {})
    return Lfm3VlConfig(**kwargs)


def build_hf_lfm3_vl(overrides: dict[str, Any] | None = None, seed: int = 0) -> Any:
    """A re-randomised fp32 `Lfm3VlForConditionalGeneration` in eval mode."""
    from transformers import Lfm3VlForConditionalGeneration

    return random_vl_model(Lfm3VlForConditionalGeneration, lfm3_vl_config(overrides), seed)


def build_tokenizer(max_len: int) -> Any:
    """Our byte tokenizer with the tool markers and the vision tokens as named specials."""
    return toks.build_byte_tokenizer(
        int(TINY_PRESETS["lfm3"]["vocab_size"]),
        model_max_length=max_len,
        chat_template=LFM3_VL_CHAT_TEMPLATE,
        named_special=(*LFM2_TOOL_TOKENS, *VISION_TOKENS),
    )


def save_processor(out: Path, max_len: int) -> None:
    """The tokenizer (with the chat template), transformers' Qwen2-VL image processor config,
    and the processor class (written as files: `Lfm3VlProcessor.save_pretrained` needs a video
    processor, which needs torchvision, and the checkpoint should build where it is absent)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    build_tokenizer(max_len).save_pretrained(str(out))
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(str(out))
    processor = {"processor_class": "Lfm3VlProcessor"}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))


def make_tiny_lfm3_vl(
    out_dir: str | Path, overrides: dict[str, Any] | None = None, seed: int = 0
) -> Path:
    """Save the tiny LFM3-VL (weights, config, generation config) and its processor."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_hf_lfm3_vl(overrides, seed)
    model.save_pretrained(str(out))
    save_processor(out, int(model.config.text_config.max_position_embeddings))
    return out
