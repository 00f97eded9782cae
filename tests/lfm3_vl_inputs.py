"""LFM3-VL requests through transformers' own processor, and transformers' greedy run.

The tiny checkpoint's `Lfm3VlProcessor` (`load_processor`: transformers' processor, its image
processor's PIL backend) renders the chat template, resizes and patchifies each image and
expands its placeholders; the engine gets its `pixel_values` and `image_grid_thw` split per
image (`GridImageInput.split`), the oracle gets the same tensors whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from oracle import OracleRun
from vision_inputs import hf_greedy

from shortconv.configs.hf.processors import load_processor
from shortconv.engine.images import GridImageInput
from shortconv.tiny.lfm3_vl import make_tiny_lfm3_vl


@dataclass(frozen=True)
class Pic:
    """A random RGB image of `height` x `width` pixels, drawn from `seed`."""

    height: int
    width: int
    seed: int = 0

    def pil(self) -> Any:
        from PIL import Image

        rng = np.random.default_rng(self.seed)
        return Image.fromarray(rng.integers(0, 256, (self.height, self.width, 3), dtype=np.uint8))


Turns = list[tuple[str, list[str | Pic]]]


def messages(turns: Turns) -> list[dict[str, Any]]:
    """ChatML turns of text and pictures → the chat template's messages (content parts)."""
    out = []
    for role, parts in turns:
        content = [
            {"type": "image"} if isinstance(p, Pic) else {"type": "text", "text": p} for p in parts
        ]
        out.append({"role": role, "content": content})
    return out


def merge(*batches: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """The processor's tensors of several requests' images, in order (images are processed one
    by one, so this is what one call with all of them returns)."""
    real = [b for b in batches if b]
    if not real:
        return None
    return {k: torch.cat([b[k] for b in real]) for k in ("pixel_values", "image_grid_thw")}


@dataclass
class Request:
    ids: list[int]
    batch: dict[str, torch.Tensor] | None  # pixel_values, image_grid_thw (None: text only)

    @property
    def images(self) -> list[GridImageInput]:
        return GridImageInput.split(self.batch) if self.batch else []


@dataclass
class Lfm3VlCase:
    """The tiny LFM3-VL checkpoint, transformers' model of it (the oracle) and its processor."""

    path: Path
    hf: torch.nn.Module = field(repr=False)
    processor: Any = field(repr=False)
    max_new: int

    def process(self, text: str, pics: list[Pic]) -> Request:
        images = [p.pil() for p in pics] or None
        out = self.processor(
            images=images, text=[text], add_special_tokens=False, return_tensors="pt"
        )
        batch = {k: out[k] for k in ("pixel_values", "image_grid_thw")} if pics else None
        return Request(out["input_ids"][0].tolist(), batch)

    def request(self, turns: Turns) -> Request:
        """A prompt of `turns` and the generation prompt, processed."""
        text = self.processor.apply_chat_template(
            messages(turns), add_generation_prompt=True, tokenize=False
        )
        return self.process(text, [p for _, parts in turns for p in parts if isinstance(p, Pic)])

    def follow_up(self, first: Request, answer: list[int], parts: list[str | Pic]) -> Request:
        """The next turn: `first`'s prompt, the generated `answer`, its end, a new user turn
        (its images processed and appended to the first's), the generation prompt."""
        end = self.processor.tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
        text = self.processor.apply_chat_template(
            messages([("user", parts)]), add_generation_prompt=True, tokenize=False
        )
        bos = self.processor.tokenizer.bos_token
        more = self.process(text.removeprefix(bos), [p for p in parts if isinstance(p, Pic)])
        return Request(first.ids + answer + end + more.ids, merge(first.batch, more.batch))

    def oracle(self, req: Request) -> OracleRun:
        return hf_greedy(self.hf, req.ids, req.batch, self.max_new)


def lfm3_vl_case(out_dir: Path, max_new: int) -> Lfm3VlCase:
    from transformers import Lfm3VlForConditionalGeneration

    path = make_tiny_lfm3_vl(out_dir, seed=3)
    hf = Lfm3VlForConditionalGeneration.from_pretrained(path).eval()
    return Lfm3VlCase(path, hf, load_processor(path), max_new)
