"""The multimodal prompt builder: chat messages and PIL images through the checkpoint's own
processor give the prompt and the engine images the engine accepts, for LFM3-VL's processor (its
PIL backend) and LFM2-VL's (its torchvision backend)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image
from vision_inputs import Image as Tiles
from vision_inputs import prompt as lfm2_vl_prompt

from deployments.frontend.images.mm_prompt import PromptBuilder, PromptError, tiles_per_image
from shortconv.engine.images import GridImageInput, ImageInput, ImageSpec, place_images
from shortconv.tiny.vision import IMAGE_TOKEN_ID, build_tokenizer

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "compare"}, {"type": "image"}]},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]},
]


def pictures() -> list[Image.Image]:
    return [Image.new("RGB", (40, 24), (200, 10, 10)), Image.new("RGB", (16, 64), (0, 90, 10))]


def test_tiles_per_image_follows_the_lfm2_vl_prompt() -> None:
    tok = build_tokenizer(1024)
    tiled, small = Tiles.tiled(2, 2, (4, 4)), Tiles(((8, 4),))
    ids, _ = lfm2_vl_prompt(tok, [("user", ["a", tiled, "b", small, small])])
    start = tok.convert_tokens_to_ids("<|image_start|>")
    assert tiles_per_image(ids, IMAGE_TOKEN_ID, start) == [5, 1, 1]
    assert tiles_per_image(ids[:3], IMAGE_TOKEN_ID, start) == []


def _lfm3_vl_builder(tmp_path: Path) -> PromptBuilder:
    from shortconv.tiny.lfm3_vl import IMAGE_TOKEN_ID as PAD
    from shortconv.tiny.lfm3_vl import MERGE, save_processor

    save_processor(tmp_path, 512)
    (tmp_path / "config.json").write_text('{"model_type": "lfm3_vl"}')
    return PromptBuilder.load(tmp_path, ImageSpec(PAD, MERGE, GridImageInput))


def test_lfm3_vl_prompt_is_the_processors(tmp_path: Path) -> None:
    builder = _lfm3_vl_builder(tmp_path)
    images = pictures()
    mm = builder.build(MESSAGES, images, add_generation_prompt=True)
    # The same processor, called by hand on the rendered text, gives the same ids and pixels.
    proc = builder.processor
    text = proc.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ref = proc(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    assert mm.token_ids == ref["input_ids"][0].tolist()
    assert all(isinstance(im, GridImageInput) for im in mm.images) and len(mm.images) == 2
    assert [im.grid_thw for im in mm.images] == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    assert sum(len(im.pixel_values) for im in mm.images) == len(ref["pixel_values"])
    placed = place_images(mm.token_ids, mm.images, builder.spec)
    assert [p.num_tokens for p in placed] == [im.num_tokens(builder.spec.downsample_factor)
                                              for im in mm.images]  # fmt: skip
    assert placed[0].end < placed[1].start


def test_processor_refusal_is_a_prompt_error(tmp_path: Path) -> None:
    builder = _lfm3_vl_builder(tmp_path)
    thin = [Image.new("RGB", (2, 900))]  # an aspect ratio the Qwen2-VL processor refuses
    with pytest.raises(PromptError):
        builder.build(MESSAGES[:2], thin, add_generation_prompt=True)


def test_lfm2_vl_prompt_is_the_processors(tmp_path: Path) -> None:
    from transformers import Lfm2VlProcessor

    from shortconv.tiny.vision import IMAGE_PROCESSOR, save_processor

    save_processor(tmp_path, 512)
    (tmp_path / "config.json").write_text('{"model_type": "lfm2_vl"}')
    spec = ImageSpec(IMAGE_TOKEN_ID, IMAGE_PROCESSOR["downsample_factor"], ImageInput)
    builder = PromptBuilder.load(tmp_path, spec)
    assert isinstance(builder.processor, Lfm2VlProcessor)
    images = [Image.new("RGB", (64, 40)), Image.new("RGB", (12, 12))]
    mm = builder.build(MESSAGES, images, add_generation_prompt=True)
    # The same processor, called by hand on the rendered text, gives the same ids and tiles.
    proc = builder.processor
    text = proc.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ref = proc(text=text, images=[images], return_tensors="pt", add_special_tokens=False)
    assert mm.token_ids == ref["input_ids"][0].tolist()
    assert all(isinstance(im, ImageInput) for im in mm.images) and len(mm.images) == 2
    tiles = [len(im.spatial_shapes) for im in mm.images]
    assert tiles[0] > 1 and tiles[1] == 1  # the first is tiled (tiles and a thumbnail)
    assert sum(tiles) == len(ref["pixel_values"])
    place_images(mm.token_ids, mm.images, spec)  # every placeholder has its image's row


def test_outputs_the_engine_refuses_are_a_prompt_error(tmp_path: Path) -> None:
    builder = _lfm3_vl_builder(tmp_path)
    # The same processor, its outputs read as LFM2-VL's tiles: no <|image_start|> to count.
    wrong = PromptBuilder(builder.processor, ImageSpec(builder.spec.image_token_id, 2, ImageInput))
    wrong.processor.image_start_token = "<|vision_start|>"
    with pytest.raises(PromptError, match="do not fit this model"):
        wrong.build(MESSAGES[:2], pictures()[:1], add_generation_prompt=True)
