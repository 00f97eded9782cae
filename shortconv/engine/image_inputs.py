"""What an image brings to the engine: its part of transformers' image processor's tensors, in
one of two kinds, chosen by the architecture (`engine.images.ImageSpec.kind`).

* `ImageInput` (LFM2-VL): the image's tiles, rows of `pixel_values` padded to the longest
  tile, and each tile's patch grid (`spatial_shapes`).
* `GridImageInput` (LFM3-VL, the Qwen2-VL image processor): the image's rows of the flat
  `pixel_values` and its `image_grid_thw` row.

Both say how many tokens they make (`num_tokens`), which patch grids they cover (`grids`, hashed
into the digest) and how a step's images batch into the model's `encode_images` arguments
(`batch`); the rest of the engine reads nothing else of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from shortconv.sampling.sampling_params import InvalidRequest

# NOTE: torch only where a tensor is made: the app's build task and the ingress import this
# module (through the chat prompt types) and never need torch itself.
if TYPE_CHECKING:
    import torch


class Digested:
    """An image's content digest, computed on first use and kept with the image: only kept
    state (prefix caching, sessions) reads it, and the service computes it on the replica's
    worker thread that made the image (deployments/frontend/images/mm_prompt.py), so a sha256 over
    every pixel never runs on the engine loop there."""

    pixel_values: torch.Tensor
    grids: Any

    @cached_property
    def digest(self) -> int:
        return image_digest(self)


def image_digest(image: Digested) -> int:
    """A negative id from the sha256 of the image's pixels (bytes, dtype, shape) and patch grids
    (`spatial_shapes` or `image_grid_thw`): equal for the same processor output, different (but
    for a 2**-63 chance) otherwise."""
    import torch

    pixels = image.pixel_values.detach().cpu().contiguous()
    h = hashlib.sha256(f"{pixels.dtype}{tuple(pixels.shape)}{image.grids}".encode())
    h.update(pixels.view(torch.uint8).numpy().tobytes())
    return -1 - int.from_bytes(h.digest()[:8], "little") // 2


@dataclass(frozen=True)
class ImageInput(Digested):
    """One image as transformers' image processor returns it: `pixel_values` `[tiles,
    max_patches, channels * p * p]` and each tile's patch grid `(h, w)`; a tile's first h * w
    rows are its patches (the rest is padding, as `pixel_attention_mask` marks)."""

    pixel_values: torch.Tensor
    spatial_shapes: tuple[tuple[int, int], ...]

    @property
    def grids(self) -> tuple[tuple[int, ...], ...]:
        return self.spatial_shapes

    def num_tokens(self, factor: int) -> int:
        return sum((h // factor) * (w // factor) for h, w in self.spatial_shapes)

    @staticmethod
    def batch(
        images: Sequence[ImageInput], device: torch.device
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Every tile of `images`, cut to its real patches and padded to the longest: `[N, L,
        P]`, and each tile's grid (LFM2-VL's `encode_images`)."""
        import torch

        tiles = [
            (t, hw)
            for im in images
            for t, hw in zip(im.pixel_values, im.spatial_shapes, strict=True)
        ]
        longest = max(h * w for _, (h, w) in tiles)
        pixels = torch.zeros(len(tiles), longest, tiles[0][0].shape[-1], device=device)
        for i, (tile, (h, w)) in enumerate(tiles):
            pixels[i, : h * w] = tile[: h * w]
        return pixels, [hw for _, hw in tiles]

    @staticmethod
    def split(
        outputs: Mapping[str, torch.Tensor], tiles_per_image: Sequence[int]
    ) -> list[ImageInput]:
        """The processor's batched outputs (`pixel_values`, `spatial_shapes`, and
        `pixel_attention_mask`, checked against them) → one ImageInput per image."""
        pixels, shapes = outputs["pixel_values"], outputs["spatial_shapes"].tolist()
        mask = outputs.get("pixel_attention_mask")
        if sum(tiles_per_image) != len(pixels):
            msg = f"{len(pixels)} tiles in pixel_values, {sum(tiles_per_image)} in the images"
            raise InvalidRequest(msg, "images")
        images, start = [], 0
        for n in tiles_per_image:
            grids = tuple((int(h), int(w)) for h, w in shapes[start : start + n])
            if mask is not None:
                real = mask[start : start + n].sum(-1).tolist()
                if real != [h * w for h, w in grids]:
                    raise InvalidRequest(
                        "pixel_attention_mask disagrees with spatial_shapes", "images"
                    )
            images.append(ImageInput(pixels[start : start + n], grids))
            start += n
        return images


@dataclass(frozen=True)
class GridImageInput(Digested):
    """One image as LFM3-VL's (Qwen2-VL's) image processor returns it: its rows of
    `pixel_values` `[h * w, channels * temporal * p * p]` (merge blocks contiguous) and its
    `image_grid_thw` row `(t, h, w)`; t is 1 for an image (a video has more frames)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]

    @property
    def grids(self) -> tuple[tuple[int, ...], ...]:
        return (self.grid_thw,)

    def num_tokens(self, factor: int) -> int:
        t, h, w = self.grid_thw
        return t * (h // factor) * (w // factor)

    @staticmethod
    def split(outputs: Mapping[str, torch.Tensor]) -> list[GridImageInput]:
        """The processor's batched outputs (`pixel_values`, `image_grid_thw`) → one
        GridImageInput per image; video outputs are refused (images only)."""
        if "pixel_values_videos" in outputs or "video_grid_thw" in outputs:
            raise InvalidRequest("video inputs are not supported (images only)", "images")
        pixels, grids = outputs["pixel_values"], outputs["image_grid_thw"].tolist()
        sizes = [t * h * w for t, h, w in grids]
        if sum(sizes) != len(pixels):
            msg = f"{len(pixels)} rows in pixel_values, {sum(sizes)} in image_grid_thw"
            raise InvalidRequest(msg, "images")
        rows = pixels.split(sizes)
        pairs = zip(rows, grids, strict=True)
        return [GridImageInput(r, (int(t), int(h), int(w))) for r, (t, h, w) in pairs]

    @staticmethod
    def batch(
        images: Sequence[GridImageInput], device: torch.device
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The images' rows, concatenated, and each one's `(h, w)` (LFM3-VL's `encode_images`)."""
        import torch

        pixels = torch.cat([im.pixel_values for im in images]).to(device)
        return pixels, [im.grid_thw[1:] for im in images]


AnyImage = ImageInput | GridImageInput
