"""LFM3-VL's images in the engine (`GridImageInput`): split from the processor's outputs, token
counts, placement, the digest over pixels and `image_grid_thw`, and what is refused."""

from __future__ import annotations

import pytest
import torch

from shortconv.engine.images import (
    GridImageInput,
    ImageInput,
    ImageSpec,
    image_digest,
    place_images,
)
from shortconv.sampling.sampling_params import InvalidRequest

IMG = 7
SPEC = ImageSpec(IMG, 2, GridImageInput)


def outputs(*grids: tuple[int, int, int], seed: int = 0) -> dict[str, torch.Tensor]:
    rows = sum(t * h * w for t, h, w in grids)
    pixels = torch.rand(rows, 96, generator=torch.Generator().manual_seed(seed))
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor(grids)}


def test_split_and_batch_keep_the_processors_rows_in_order() -> None:
    batch = outputs((1, 4, 6), (1, 2, 2))
    one, two = GridImageInput.split(batch)
    assert (one.grid_thw, two.grid_thw) == ((1, 4, 6), (1, 2, 2))
    assert (one.num_tokens(2), two.num_tokens(2)) == (6, 1)
    pixels, grids = GridImageInput.batch([one, two], torch.device("cpu"))
    assert torch.equal(pixels, batch["pixel_values"]) and grids == [(4, 6), (2, 2)]


def test_split_refuses_rows_that_disagree_with_the_grids() -> None:
    batch = outputs((1, 4, 6))
    with pytest.raises(InvalidRequest, match="image_grid_thw"):
        GridImageInput.split(batch | {"image_grid_thw": torch.tensor([[1, 4, 4]])})


def test_place_images_counts_merged_tokens() -> None:
    (image,) = GridImageInput.split(outputs((1, 4, 6)))
    prompt = [1, IMG, IMG, IMG, IMG, IMG, IMG, 3]
    (placed,) = place_images(prompt, [image], SPEC)
    assert placed.spans == ((1, 6),)
    with pytest.raises(InvalidRequest, match="image tokens"):
        place_images(prompt[:-2], [image], SPEC)


def test_place_images_refuses_videos_odd_grids_and_the_other_kind() -> None:
    (video,) = GridImageInput.split(outputs((2, 2, 2)))
    with pytest.raises(InvalidRequest, match="video"):
        place_images([IMG, IMG], [video], SPEC)
    (odd,) = GridImageInput.split(outputs((1, 3, 2)))
    with pytest.raises(InvalidRequest, match="multiple of 2"):
        place_images([IMG] * 2, [odd], SPEC)
    tiles = ImageInput(torch.zeros(1, 16, 48), ((2, 2),))
    with pytest.raises(InvalidRequest, match="GridImageInput"):
        place_images([IMG], [tiles], SPEC)


def test_the_digest_covers_pixels_and_the_grid() -> None:
    (a,) = GridImageInput.split(outputs((1, 4, 6)))
    assert image_digest(a) == image_digest(GridImageInput(a.pixel_values.clone(), a.grid_thw))
    assert image_digest(GridImageInput(a.pixel_values, (1, 6, 4))) != image_digest(a)
    (other,) = GridImageInput.split(outputs((1, 4, 6), seed=1))
    assert image_digest(other) != image_digest(a) < 0
