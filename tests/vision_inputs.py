"""Processor-shaped LFM2-VL inputs for the tiny checkpoint, and transformers' greedy run.

Most LFM2-VL cases need an exact tile layout (a chunk boundary inside a tile, a preemption at a
given page count), which an image size only reaches through the processor's resizing rules; so
they build what transformers' Lfm2VlImageProcessor returns, in its layout, with chosen grids:
normalised patch rows `[tiles, max_patches, 3 * p * p]` padded with zeros,
`pixel_attention_mask`, `spatial_shapes`, and the prompt expanded as
`Lfm2VlProcessor._build_image_tokens` expands it (image start/end, one row/col marker per
tile, a thumbnail after the tiles). The model under test gets them exactly as the oracle does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from oracle import OracleRun

from shortconv.engine.images import ImageInput
from shortconv.tiny.vision import IMAGE_PROCESSOR, build_tokenizer, make_tiny_lfm2_vl

PATCH = IMAGE_PROCESSOR["encoder_patch_size"]
FACTOR = IMAGE_PROCESSOR["downsample_factor"]
TILE = IMAGE_PROCESSOR["tile_size"] // PATCH  # patches per tile side
MAX_PATCHES = IMAGE_PROCESSOR["max_image_tokens"] * FACTOR**2


@dataclass(frozen=True)
class Image:
    """One image: its tiles' patch grids (a tiled image: rows x cols tiles, then a thumbnail)."""

    grids: tuple[tuple[int, int], ...]
    rows: int = 1
    cols: int = 1

    @staticmethod
    def tiled(rows: int, cols: int, thumbnail: tuple[int, int]) -> Image:
        return Image(((TILE, TILE),) * (rows * cols) + (thumbnail,), rows, cols)


def tokens_of(grid: tuple[int, int]) -> int:
    return (grid[0] // FACTOR) * (grid[1] // FACTOR)


def image_tokens(tok, image: Image) -> list[int]:
    """The placeholder run of one image, with the processor's special tokens."""
    ids = tok.convert_tokens_to_ids
    out, place = [ids("<|image_start|>")], ids("<image>")
    if len(image.grids) > 1:
        for t in range(image.rows * image.cols):
            out += [ids(f"<|img_row_{t // image.cols + 1}_col_{t % image.cols + 1}|>")]
            out += [place] * tokens_of(image.grids[t])
        out += [ids("<|img_thumbnail|>")]
    out += [place] * tokens_of(image.grids[-1])
    return out + [ids("<|image_end|>")]


def turn(tok, role: str, parts: list[str | Image]) -> tuple[list[int], list[Image]]:
    """One ChatML turn of text and images → its token ids (images expanded) and its images."""
    ids, images = tok.encode(f"<|im_start|>{role}\n", add_special_tokens=False), []
    for part in parts:
        if isinstance(part, Image):
            ids += image_tokens(tok, part)
            images.append(part)
        else:
            ids += tok.encode(part, add_special_tokens=False)
    return ids + tok.encode("<|im_end|>\n", add_special_tokens=False), images


def prompt(tok, turns: list[tuple[str, list[str | Image]]]) -> tuple[list[int], list[Image]]:
    """ChatML turns of text and images → token ids (images expanded) and the images in order."""
    ids, images = [tok.bos_token_id], []
    for role, parts in turns:
        more, found = turn(tok, role, parts)
        ids, images = ids + more, images + found
    ids += tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    return ids, images


def follow_up(
    tok, ids: list[int], answer: list[int], parts: list[str | Image]
) -> tuple[list[int], list[Image]]:
    """The next turn's prompt: `ids`, the generated `answer`, its end, a new user turn."""
    more, images = turn(tok, "user", parts)
    end = tok.encode("<|im_end|>\n", add_special_tokens=False)
    start = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    return ids + answer + end + more + start, images


def pixels(images: list[Image], seed: int) -> dict[str, torch.Tensor]:
    """The processor's three tensors for `images` (all tiles, in order)."""
    gen = torch.Generator().manual_seed(seed)
    grids = [g for im in images for g in im.grids]
    values = torch.zeros(len(grids), MAX_PATCHES, 3 * PATCH * PATCH)
    mask = torch.zeros(len(grids), MAX_PATCHES, dtype=torch.int64)
    for i, (h, w) in enumerate(grids):
        values[i, : h * w] = torch.rand(h * w, 3 * PATCH * PATCH, generator=gen) * 2 - 1
        mask[i, : h * w] = 1
    shapes = torch.tensor(grids, dtype=torch.int64)
    return {"pixel_values": values, "pixel_attention_mask": mask, "spatial_shapes": shapes}


def engine_images(images: list[Image], batch: dict[str, torch.Tensor]) -> list[ImageInput]:
    return ImageInput.split(batch, [len(im.grids) for im in images])


@torch.inference_mode()
def hf_greedy(model, ids: list[int], batch: dict[str, torch.Tensor] | None, n: int) -> OracleRun:
    """transformers' `generate` (greedy, EOS off) with the same inputs; margins from its logits."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    kwargs = dict(batch or {})
    if "pixel_attention_mask" in kwargs:
        kwargs["pixel_attention_mask"] = kwargs["pixel_attention_mask"].bool()
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
        generation_config=cfg,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    margins = []
    for logits in out.logits:
        top2 = torch.topk(logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return OracleRun(tokens, margins)


@dataclass
class VisionCase:
    """The tiny LFM2-VL checkpoint, transformers' model of it (the oracle) and its tokenizer."""

    path: Path
    hf: torch.nn.Module = field(repr=False)
    tok: object = field(repr=False)
    max_new: int

    def request(self, turns, seed: int = 0) -> tuple[list[int], dict | None, list[Image]]:
        """Token ids, the processor's tensors (None without images) and the images."""
        ids, images = prompt(self.tok, turns)
        return ids, (pixels(images, seed) if images else None), images

    def oracle(self, ids: list[int], batch: dict | None) -> OracleRun:
        return hf_greedy(self.hf, ids, batch, self.max_new)


def vision_case(out_dir: Path, max_new: int) -> VisionCase:
    from transformers import Lfm2VlForConditionalGeneration

    path = make_tiny_lfm2_vl(out_dir, seed=3)
    hf = Lfm2VlForConditionalGeneration.from_pretrained(path).eval()
    return VisionCase(path, hf, build_tokenizer(1024), max_new)
