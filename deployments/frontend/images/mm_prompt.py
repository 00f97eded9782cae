"""The multimodal prompt builder: chat messages and their decoded images -> the engine's input
(token ids with each image's placeholders expanded, and one engine image per image).

All of it is the checkpoint's own transformers processor (`AutoProcessor` from the model
directory, or LFM3-VL's image-only form where torchvision is missing; configs/hf/processors.py): its
chat template renders the messages, and its image processor resizes, tiles and normalises each
image and expands its placeholders, so the token counts match the model. CPU work: the replica
runs `build` in a worker thread, never on its event loop nor on the engine's step thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from shortconv.engine.images import AnyImage, GridImageInput, ImageInput, ImageSpec

if TYPE_CHECKING:  # NOTE: types only: the app's build task imports this module, not torch
    import torch


class PromptError(ValueError):
    """The processor refused these messages or images (the message says how)."""


@dataclass(frozen=True)
class MultimodalPrompt:
    token_ids: list[int]
    images: tuple[AnyImage, ...]


class PromptBuilder:
    """One checkpoint's processor and what its outputs become in the engine (`spec.kind`)."""

    def __init__(self, processor: Any, spec: ImageSpec) -> None:
        self.processor, self.spec = processor, spec

    @staticmethod
    def load(model_dir: str | Path, spec: ImageSpec) -> PromptBuilder:
        from shortconv.configs.hf.processors import load_processor

        return PromptBuilder(load_processor(model_dir), spec)

    def build(
        self,
        messages: list[dict[str, Any]],
        images: Sequence[Image.Image],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> MultimodalPrompt:
        """`messages` with `{"type": "image"}` parts, filled in order from `images`."""
        try:
            out = self.processor.apply_chat_template(
                _with_images(messages, images),
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                **({"tools": tools} if tools else {}),
            )
        except Exception as exc:  # jinja or the image processor refused these inputs
            raise PromptError(f"the processor refused this request: {exc}") from None
        ids = [int(t) for t in out["input_ids"][0]]
        try:
            engine_images = tuple(self._engine_images(out, ids))
        except (ValueError, KeyError) as exc:  # outputs the engine's image kind refuses or lacks
            raise PromptError(f"the processor's outputs do not fit this model: {exc}") from None
        for image in engine_images:
            image.digest  # noqa: B018  (here, on this worker thread, not on the engine loop)
        return MultimodalPrompt(ids, engine_images)

    def _engine_images(self, out: Mapping[str, torch.Tensor], ids: list[int]) -> list[AnyImage]:
        if self.spec.kind is GridImageInput:
            return GridImageInput.split(out)
        start = self.processor.tokenizer.convert_tokens_to_ids(self.processor.image_start_token)
        tiles = tiles_per_image(ids, self.spec.image_token_id, start)
        return ImageInput.split(out, tiles)


def _with_images(
    messages: list[dict[str, Any]], images: Sequence[Image.Image]
) -> list[dict[str, Any]]:
    left = iter(images)
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            parts = [{"type": "image", "image": next(left)} if p["type"] == "image" else p
                     for p in content]  # fmt: skip
            msg = {**msg, "content": parts}
        out.append(msg)
    return out


def tiles_per_image(ids: Sequence[int], image_token_id: int, image_start_id: int) -> list[int]:
    """LFM2-VL's processor drops each image's tile count (its rows x cols, plus a thumbnail)
    from its outputs, but its prompt shows it: every image opens with `<|image_start|>` and each
    of its tiles is one run of placeholders (a row/col marker or the thumbnail marker between)."""
    counts: list[int] = []
    in_run = False
    for t in ids:
        if t == image_start_id:
            counts.append(0)
        elif t == image_token_id and not in_run and counts:
            counts[-1] += 1
        in_run = t == image_token_id
    return counts
