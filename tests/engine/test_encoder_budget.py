"""The step budget counts encoder work: a chunk pays each image it encodes at the image's token
count, ends before an image it cannot afford, and encodes an image it starts in whatever it
costs (with at least one token), so encoding and prefill of one image land in different steps
while streams decode."""

from __future__ import annotations

import torch

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.engine.encoder_planner import EncoderPlanner
from shortconv.engine.images import ImageInput, ImageSpec, place_images
from shortconv.engine.plan import StepPlan, StepResult
from shortconv.engine.request import Request
from shortconv.engine.scheduler import Scheduler, SchedulerConfig
from shortconv.sampling.sampling_params import SamplingParams

IMG = 9
SPEC = ImageSpec(image_token_id=IMG, downsample_factor=2)
STREAM = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
# Two 8-token images (4x8 patch grids): text 0..2, image a 3..10, text 11..12, image b 13..20.
PROMPT = [1, 2, 3] + [IMG] * 8 + [5, 6] + [IMG] * 8 + [7, 8]


def request(rid: str = "r", prompt: list[int] = PROMPT) -> Request:
    images = [ImageInput(torch.rand(1, 64, 12), ((4, 8),)) for _ in range(prompt.count(IMG) // 8)]
    return Request(rid, list(prompt), ONE, 0, images=place_images(prompt, images, SPEC))


def test_a_chunk_pays_for_the_images_it_encodes() -> None:
    planner, req = EncoderPlanner(), request()
    assert planner.fit(req, 0, 23, 512) == (23, 23 + 16)  # both images fit
    assert planner.fit(req, 0, 23, 30) == (14, 14 + 16)  # shorter, b's first token the last
    assert planner.fit(req, 0, 23, 20) == (12, 12 + 8)  # b is beyond the shorter chunk
    assert planner.fit(req, 0, 10, 10) == (3, 3)  # a does not fit: the text before it


def test_an_image_the_chunk_starts_in_is_encoded_with_fewer_tokens() -> None:
    planner, req = EncoderPlanner(), request()
    assert planner.fit(req, 3, 16, 12) == (4, 4 + 8)
    assert planner.fit(req, 3, 16, 6) == (1, 1 + 8), "at least one token, over the budget"
    assert planner.fit(req, 5, 16, 12) == (4, 4 + 8), "a resume inside the image pays it too"
    req.encoder_keys[0] = 1  # a kept image costs nothing more
    assert planner.fit(req, 5, 8, 12) == (8, 8)


def test_while_streams_decode_no_step_both_encodes_and_prefills_an_image() -> None:
    cap = 8
    cfg = SchedulerConfig(4, 64, 1024, 8, max_prefill_tokens_while_decoding=cap)
    s = Scheduler(cfg, SlotAllocator(9), PageAllocator(64))
    s.add(Request("stream", [5, 6, 7], STREAM, seed=0))
    run(s)
    s.add(request("images"))
    plans = []
    while "images" in s.requests:
        plans.append(run(s))
    for plan in plans:
        tokens = sum(c.num_tokens for c in plan.seqs if c.request_id == "images")
        work = sum(e.image.num_tokens(2) for e in plan.encoder_inputs)
        assert tokens + work <= cap or (work and tokens == 1), plan
    assert sum(len(p.encoder_inputs) for p in plans) == 2


def run(s: Scheduler) -> StepPlan:
    plan = s.schedule()
    assert plan is not None
    rows = tuple(c.request_id for c in plan.seqs if c.sampling is not None)
    n = len(rows)
    s.update(plan, StepResult(plan.step_id, rows, (3,) * n, (None,) * n, (None,) * n))
    return plan
