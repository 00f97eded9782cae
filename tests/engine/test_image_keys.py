"""Images in the keys of kept state: a request's key stream names each image by its digest, so
the cache manager resumes the same image and text and misses a different image behind the same
text, at the image's first placeholder (a checkpoint inside an image included)."""

from __future__ import annotations

import pytest
import torch

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.manager import CacheManager, StepCopies
from shortconv.engine.images import ImageInput, ImageSpec, image_digest, key_stream, place_images
from shortconv.engine.request import Request
from shortconv.sampling.sampling_params import SamplingParams

IMG = 9
SPEC = ImageSpec(image_token_id=IMG, downsample_factor=2)
PS = 4
P = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# Text, an 8-token image (one 4x8 tile) from position 3 to 11, text after it.
PROMPT = [1, 2, 3] + [IMG] * 8 + [5, 6, 7, 8, 10]


def image(seed: int, grid: tuple[int, int] = (4, 8)) -> ImageInput:
    gen = torch.Generator().manual_seed(seed)
    return ImageInput(torch.rand(1, 64, 12, generator=gen), (grid,))


def request(rid: str, prompt: list[int], images: list[ImageInput], session=None) -> Request:
    placed = place_images(prompt, images, SPEC)
    return Request(rid, list(prompt), P, 0, session_id=session, images=placed)


def manager(caching: bool = True) -> CacheManager:
    return CacheManager(
        SlotAllocator(16),
        PageAllocator(64),
        PS,
        prefix_caching=caching,
        checkpoint_interval=PS,
        session_ttl_s=60.0,
    )


def run(cm: CacheManager, req: Request, answer: tuple[int, ...] = (7, 8)) -> Request:
    """Admit (maybe resuming), prefill the rest in one chunk, decode `answer`, finish."""
    n = cm.admit(req, 1000, StepCopies())
    for tok in answer:
        assert cm.grow(req, req.num_computed + n)
        cm.plan_checkpoints(req, req.num_computed, n, StepCopies())
        req.num_computed += n
        cm.commit_checkpoints(req)
        req.output_token_ids.append(tok)
        n = 1
    cm.finish(req, completed=True)
    return req


def test_the_digest_is_the_content() -> None:
    a, b = image(0), image(0)
    assert a.pixel_values is not b.pixel_values and image_digest(a) == image_digest(b)
    assert image_digest(a) < 0, "a digest never equals a token id"
    assert image_digest(image(1)) != image_digest(a)
    # The same pixel bytes under another patch grid are another image.
    assert image_digest(ImageInput(a.pixel_values, ((8, 4),))) != image_digest(a)
    flipped = a.pixel_values.clone()
    flipped[0, 0, 0] += 1e-6
    assert image_digest(ImageInput(flipped, a.spatial_shapes)) != image_digest(a)


def test_the_key_stream_puts_the_digest_over_the_placeholders() -> None:
    req = request("r", PROMPT, [image(0)])
    (placed,) = req.images
    assert req.prompt_key_ids == [1, 2, 3] + [placed.digest] * 8 + [5, 6, 7, 8, 10]
    assert req.prompt_token_ids == PROMPT, "the tokens themselves are unchanged"
    req.output_token_ids.append(11)
    assert req.all_key_ids == req.prompt_key_ids + [11]
    text = Request("t", [1, 2, 3], P, 0)
    assert key_stream(text.prompt_token_ids, ()) is text.prompt_token_ids


def test_same_image_hits_and_another_image_misses_at_its_first_token() -> None:
    cm = manager()
    run(cm, request("a", PROMPT, [image(0)]))
    same = run(cm, request("b", PROMPT, [image(0)]))
    # The deepest checkpoint before the prompt's last token: the interval one at 12.
    assert same.num_cached_tokens == 12
    other = run(cm, request("c", PROMPT, [image(1)]))
    # Only the interval checkpoints before the image's first token (position 3) could match:
    # the first is at 4, inside the image, so nothing resumes.
    assert other.num_cached_tokens == 0
    # A longer text prefix: the checkpoint at 4 lies before the image (now at 5..12).
    longer = [1, 2, 3, 4, 0] + [IMG] * 8 + [5, 6]
    run(cm, request("d", longer, [image(0)]))
    assert run(cm, request("e", longer, [image(2)])).num_cached_tokens == 4


def test_a_checkpoint_inside_an_image_resumes_only_that_image() -> None:
    """The checkpoint at 8 covers 5 of the image's 8 tokens; it carries the whole image's
    digest, so another prompt with the same image and other text after it resumes there."""
    cm = manager()
    run(cm, request("a", PROMPT, [image(0)]))
    tail = PROMPT[:11] + [12, 13]
    assert run(cm, request("b", tail, [image(0)])).num_cached_tokens == 8
    assert run(cm, request("c", tail, [image(3)])).num_cached_tokens == 0


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_a_sessions_next_turn_resumes_only_with_the_same_image(caching: bool) -> None:
    cm = manager(caching)
    first = run(cm, request("a", PROMPT, [image(0)], session="s"))
    turn2 = first.all_token_ids[:-1] + [8, 14, 15]  # the answer but its last token, a new turn
    resumed = run(cm, request("b", turn2, [image(0)], session="s"))
    assert resumed.num_cached_tokens == len(PROMPT) + 1
    # The same conversation with another image: the session's pins do not prefix it.
    turn3 = resumed.all_token_ids[:-1] + [16]
    assert run(cm, request("c", turn3, [image(5)], session="s")).num_cached_tokens == 0
