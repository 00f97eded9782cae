"""Images in requests: placing them over the prompt's placeholders, planning the encoder cache
across chunks and preemption, and the refusals that name what is wrong."""

from __future__ import annotations

import pytest
import torch

from shortconv.engine.encoder_planner import EncoderPlanner
from shortconv.engine.images import ImageInput, ImageSlice, ImageSpec, place_images
from shortconv.engine.request import Request
from shortconv.sampling.sampling_params import InvalidRequest, SamplingParams

IMG = 9
SPEC = ImageSpec(image_token_id=IMG, downsample_factor=2)


def image(*grids: tuple[int, int]) -> ImageInput:
    return ImageInput(torch.zeros(len(grids), 64, 48), tuple(grids))


def test_images_take_the_placeholders_in_order() -> None:
    # Image a: one 4x4 tile (4 tokens); image b: two 2x4 tiles (2 + 2) split by a marker.
    prompt = [1, IMG, IMG, IMG, IMG, 5, IMG, IMG, 7, IMG, IMG, 3]
    a, b = place_images(prompt, [image((4, 4)), image((2, 4), (2, 4))], SPEC)
    assert a.spans == ((1, 4),) and (a.start, a.end) == (1, 5)
    assert b.spans == ((6, 2), (9, 2)) and (b.start, b.end) == (6, 11)


@pytest.mark.parametrize(
    ("prompt", "images", "match"),
    [
        ([1, IMG, IMG, 2], [image((4, 4))], "has 2 image tokens but its images need 4"),
        ([1, IMG, 2], [], "has 1 image tokens but its images need 0"),
        ([1, IMG, IMG, IMG, 2], [image((3, 2))], "not a multiple of 2"),
    ],
)
def test_bad_placement_is_refused(prompt, images, match) -> None:
    with pytest.raises(InvalidRequest, match=match):
        place_images(prompt, images, SPEC)


def test_split_checks_the_mask_against_the_grids() -> None:
    pixels = torch.zeros(3, 64, 48)
    mask = torch.zeros(3, 64, dtype=torch.int64)
    mask[0, :16], mask[1, :8], mask[2, :8] = 1, 1, 1
    batch = {"pixel_values": pixels, "spatial_shapes": torch.tensor([[4, 4], [2, 4], [2, 4]])}
    one, two = ImageInput.split(batch | {"pixel_attention_mask": mask}, [1, 2])
    assert one.spatial_shapes == ((4, 4),) and two.spatial_shapes == ((2, 4), (2, 4))
    mask[2, 8] = 1
    with pytest.raises(InvalidRequest, match="disagrees"):
        ImageInput.split(batch | {"pixel_attention_mask": mask}, [1, 2])


def _request(prompt: list[int], images: list[ImageInput]) -> Request:
    placed = place_images(prompt, images, SPEC)
    return Request("r", prompt, SamplingParams(), 0, images=placed)


def test_planner_encodes_once_and_frees_after_the_last_chunk() -> None:
    prompt = [1, IMG, IMG, IMG, IMG, 5, IMG, IMG, 7, IMG, IMG, 3]
    req, planner = _request(prompt, [image((4, 4)), image((2, 4), (2, 4))]), EncoderPlanner()
    first = planner.chunk_images(req, 0, 3)  # positions 0..2: image a's rows 0..1
    inputs, frees = planner.take()
    (a_key,) = [e.key for e in inputs]
    assert first == (ImageSlice(a_key, 0, 1, 2),) and frees == ()
    second = planner.chunk_images(req, 3, 7)  # 3..9: a's rows 2..3, all b's first tile, b row 2
    inputs, frees = planner.take()
    (b_key,) = [e.key for e in inputs]
    assert second == (
        ImageSlice(a_key, 2, 0, 2),
        ImageSlice(b_key, 0, 3, 2),
        ImageSlice(b_key, 2, 6, 1),
    )
    assert frees == (a_key,) and req.encoder_keys == {1: b_key}
    assert planner.chunk_images(req, 10, 2) == (ImageSlice(b_key, 3, 0, 1),)
    assert planner.take() == ((), (b_key,)) and req.encoder_keys == {}


def test_preemption_frees_and_recompute_encodes_again() -> None:
    prompt = [1, IMG, IMG, IMG, IMG, 5]
    req, planner = _request(prompt, [image((4, 4))]), EncoderPlanner()
    planner.chunk_images(req, 0, 3)
    (old,), _ = planner.take()
    planner.release(req)  # preempted mid-image
    assert planner.take() == ((), (old.key,))
    planner.chunk_images(req, 0, 6)
    (new,), frees = planner.take()
    assert new.key != old.key and frees == (new.key,)
    planner.release(req)  # finished: nothing is held twice
    assert planner.take() == ((), ())
