"""Images in a request: what the processor gives per image, where its tokens sit in the prompt,
and what a step plan carries to encode them and to place their embeddings.

A request's prompt holds the image placeholder tokens already expanded (as transformers'
processor expands them); each image brings its part of the processor's tensors, in the kind its
model takes (`engine.image_inputs`: LFM2-VL's tiles or LFM3-VL's patch rows and grid). An
image fills, in order, the next `num_tokens` placeholders of the prompt. The step budget counts
an image's placeholders as prompt tokens (they are) and, in the chunk that encodes it, its token
count again for the encoder's work (`engine.encoder_planner`).

Kept state (prefix-cache checkpoints, a session's turns) is keyed by a request's key stream
(`key_stream`): its prompt with every placeholder of an image replaced by that image's digest (a
negative id, so it never equals a token). A checkpoint's key then names every image it covers,
from the image's first token on, so a checkpoint inside an image is as sound as one after it: the
same image hits and a different image behind the same text misses at its first placeholder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shortconv.configs.config import ModelConfig
from shortconv.configs.hf import lfm2_vl, lfm3_vl
from shortconv.engine.image_inputs import AnyImage, GridImageInput, ImageInput, image_digest
from shortconv.sampling.sampling_params import InvalidRequest

# NOTE: re-exported: the engine, the tests and the request path import the kinds from here.
__all__ = [
    "AnyImage",
    "EncoderInput",
    "GridImageInput",
    "ImageInput",
    "ImageSlice",
    "ImageSpec",
    "PlacedImage",
    "image_digest",
    "key_stream",
    "place_images",
]


@dataclass(frozen=True)
class ImageSpec:
    """What the engine needs of a vision model: the placeholder id, the downsampling of a patch
    grid into tokens, and the kind of image its processor makes."""

    image_token_id: int
    downsample_factor: int
    kind: type[ImageInput] | type[GridImageInput] = ImageInput

    @staticmethod
    def of(cfg: ModelConfig) -> ImageSpec | None:
        """None for a text-only architecture."""
        if cfg.arch == "lfm2_vl":
            v = lfm2_vl.vision_config(cfg.raw)
            return ImageSpec(v.image_token_id, v.downsample_factor, ImageInput)
        if cfg.arch == "lfm3_vl":
            w = lfm3_vl.vision_config(cfg.raw)
            return ImageSpec(w.image_token_id, w.merge, GridImageInput)
        return None


@dataclass(frozen=True)
class PlacedImage:
    """An image, the prompt runs `(position, length)` its tokens replace, in order, and the
    digest of its content that stands for its tokens in the key stream."""

    image: AnyImage
    spans: tuple[tuple[int, int], ...]

    @property
    def start(self) -> int:
        return self.spans[0][0]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.spans)

    @property
    def end(self) -> int:
        pos, n = self.spans[-1]
        return pos + n

    @property
    def digest(self) -> int:
        return self.image.digest  # computed once per image (image_inputs.Digested)


def key_stream(prompt: list[int], images: Sequence[PlacedImage]) -> list[int]:
    """`prompt` with each image's placeholders replaced by its digest (`prompt` itself without
    images): what prefix-cache checkpoints and session resumes are keyed by."""
    if not images:
        return prompt
    keys = list(prompt)
    for image in images:
        for pos, n in image.spans:
            keys[pos : pos + n] = [image.digest] * n
    return keys


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def _check_image(image: AnyImage, spec: ImageSpec) -> None:
    f = spec.downsample_factor
    if not isinstance(image, spec.kind):
        raise InvalidRequest(f"this model takes {spec.kind.__name__}s as images", "images")
    if any(g[-2] % f or g[-1] % f for g in image.grids):
        raise InvalidRequest(f"an image's patch grid is not a multiple of {f}", "images")
    if any(len(g) == 3 and g[0] != 1 for g in image.grids):
        raise InvalidRequest("video inputs are not supported (an image has one frame)", "images")


def place_images(
    prompt: Sequence[int], images: Sequence[AnyImage], spec: ImageSpec
) -> tuple[PlacedImage, ...]:
    """Assign each image its placeholders, or refuse a prompt whose count does not match."""
    slots = [i for i, t in enumerate(prompt) if t == spec.image_token_id]
    f = spec.downsample_factor
    for image in images:
        _check_image(image, spec)
    need = [image.num_tokens(f) for image in images]
    if sum(need) != len(slots):
        raise InvalidRequest(
            f"the prompt has {len(slots)} image tokens but its images need {sum(need)}", "images"
        )
    placed, used = [], 0
    for image, n in zip(images, need, strict=True):
        placed.append(PlacedImage(image, tuple(_runs(slots[used : used + n]))))
        used += n
    return tuple(placed)


@dataclass(frozen=True)
class ImageSlice:
    """Rows [src, src + length) of encoder-cache entry `key` replace the embeddings of this
    chunk's tokens [dst, dst + length)."""

    key: int
    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class EncoderInput:
    """An image a step encodes, kept in the runner's encoder cache under `key`."""

    key: int
    image: AnyImage
