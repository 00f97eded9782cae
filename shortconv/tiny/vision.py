"""A tiny random LFM2-VL checkpoint with its processor, for `model: null` and the parity tests.

    python -m shortconv.tiny.vision --out DIR [--seed N]

Beside the weights it saves what `AutoProcessor.from_pretrained(DIR)` needs: transformers' own
`Lfm2VlImageProcessor` config (sized so a tiny image tiles: 4-pixel patches, 16-pixel tiles,
at most 16 tokens for an untiled image), the byte-level tokenizer with the image tokens as
named specials, and a ChatML template whose content parts may be images.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shortconv.engine import tokenizer as toks
from shortconv.tiny.presets import TINY_PRESETS, TOKEN_IDS
from shortconv.tiny.rerandomize import random_vl_model
from shortconv.tiny.templates import LFM2_TOOL_TOKENS, LFM2_VL_CHAT_TEMPLATE

MAX_TILES = 4
IMAGE_TOKENS: tuple[str, ...] = (
    "<image>",
    "<|image_start|>",
    "<|image_end|>",
    "<|img_thumbnail|>",
    *(f"<|img_row_{r}_col_{c}|>" for r in range(1, MAX_TILES + 1) for c in range(1, MAX_TILES + 1)),
)
# Named specials follow the 4 specials and 256 bytes, the tool markers first.
IMAGE_TOKEN_ID = toks.BYTE_TOKEN_OFFSET + toks.NUM_BYTE_TOKENS + len(LFM2_TOOL_TOKENS)

VISION_PRESET: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 4,
    "num_patches": 16,  # a 4 x 4 position grid, resized to each image's patch grid
    "vision_use_head": False,
}
# Lfm2VlImageProcessor at tiny sizes: an image of more than 16 tokens (64 patches) is split
# into 16-pixel tiles (4 tokens each) plus a thumbnail.
IMAGE_PROCESSOR: dict[str, Any] = {
    "encoder_patch_size": 4,
    "downsample_factor": 2,
    "tile_size": 16,
    "min_image_tokens": 2,
    "max_image_tokens": 16,
    "min_tiles": 2,
    "max_tiles": MAX_TILES,
    "do_image_splitting": True,
    "use_thumbnail": True,
}


def lfm2_vl_config(overrides: dict[str, Any] | None = None) -> Any:
    """The tiny `Lfm2VlConfig`: the tiny LFM2 as its text model."""
    from transformers import Lfm2VlConfig

    text = dict(TINY_PRESETS["lfm2"], model_type="lfm2")
    kwargs: dict[str, Any] = {
        "text_config": text,
        "vision_config": dict(VISION_PRESET, model_type="siglip2_vision_model"),
        "image_token_id": IMAGE_TOKEN_ID,
        "projector_hidden_size": 48,
        "downsample_factor": IMAGE_PROCESSOR["downsample_factor"],
        "tie_word_embeddings": True,
        **TOKEN_IDS,
    }
    kwargs.update(overrides or {})
    return Lfm2VlConfig(**kwargs)


def build_hf_lfm2_vl(overrides: dict[str, Any] | None = None, seed: int = 0) -> Any:
    """A re-randomised fp32 `Lfm2VlForConditionalGeneration` in eval mode."""
    from transformers import Lfm2VlForConditionalGeneration

    return random_vl_model(Lfm2VlForConditionalGeneration, lfm2_vl_config(overrides), seed)


def build_tokenizer(max_len: int) -> Any:
    """Our byte tokenizer with the tool markers and the image tokens as named specials."""
    return toks.build_byte_tokenizer(
        int(TINY_PRESETS["lfm2"]["vocab_size"]),
        model_max_length=max_len,
        chat_template=LFM2_VL_CHAT_TEMPLATE,
        named_special=(*LFM2_TOOL_TOKENS, *IMAGE_TOKENS),
    )


def save_processor(out: Path, max_len: int) -> None:
    """What `AutoProcessor.from_pretrained(out)` reads: the tokenizer (with the chat template)
    and transformers' own Lfm2VlImageProcessor, named with its settings.

    NOTE: written as config files rather than through `Lfm2VlProcessor.save_pretrained`,
    which builds the torchvision-backed image processor: the tiny checkpoint (and so a
    `model: null` replica serving text) still builds where torchvision does not import."""
    build_tokenizer(max_len).save_pretrained(str(out))
    image = {"image_processor_type": "Lfm2VlImageProcessor", "processor_class": "Lfm2VlProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(image | IMAGE_PROCESSOR, indent=2))
    processor = {"processor_class": "Lfm2VlProcessor"}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))


def make_tiny_lfm2_vl(
    out_dir: str | Path, overrides: dict[str, Any] | None = None, seed: int = 0
) -> Path:
    """Save the tiny LFM2-VL (weights, config, generation config) and its processor."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_hf_lfm2_vl(overrides, seed)
    model.save_pretrained(str(out))
    save_processor(out, int(model.config.text_config.max_position_embeddings))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(make_tiny_lfm2_vl(args.out, seed=args.seed))


if __name__ == "__main__":
    main()
