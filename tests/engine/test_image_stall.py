"""No decode stall from images: one request with 4 of the largest images the tiny processor
makes arrives while 8 text streams decode. Each stream gets a token every step; the gap between
two of its tokens, in tokens computed and in time, keeps its p99 within 2x of the same run
without the image request (docs/vision.md: the step budget counts encoder work).

Time is the engine thread's CPU time with torch on one thread: on a machine shared with other
work, wall time measures the other work as much as ours (both are printed).

NOTE: the step cap here is 16 prompt tokens, not the CPU default (32). On this tiny model a
step of 8 decode rows and 32 prompt tokens alone costs 1.8-1.9x a decode-only step, images or
not, so at the default the 2x bound measures the cap, with no margin for a loaded machine; the
images' share (the budget counting encoder work) is what this test is about."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from vision_inputs import Image, engine_images, pixels, prompt, tokens_of

from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.plan import StepPlan, StepResult
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.vision import IMAGE_PROCESSOR, build_tokenizer, make_tiny_lfm2_vl

STREAMS = 8
WINDOW = 40  # steps measured, the image request arriving at the second
STREAM = SamplingParams(temperature=0.0, max_tokens=WINDOW + 8, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
FACTOR = IMAGE_PROCESSOR["downsample_factor"]
# The largest image the tiny processor makes: the most tiles (2 x 2) and the largest thumbnail
# (max_image_tokens after the downsampling: 8 x 8 patches).
SIDE = int(IMAGE_PROCESSOR["max_image_tokens"] ** 0.5) * FACTOR
LARGE = Image.tiled(2, 2, (SIDE, SIDE))
REPEATS = 7  # runs of each kind, each step's gap taken at its least (see `steady_p99`)
CAP = 16  # prompt tokens per step while streams decode (see the NOTE above)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMEngine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = make_tiny_lfm2_vl(tmp_path_factory.mktemp("lfm2_vl"), seed=3)
    yield build_engine(
        path, dtype="float32", engine_config=EngineConfig(max_prefill_tokens_while_decoding=CAP)
    )
    torch.set_num_threads(threads)


@dataclass
class Gaps:
    """Per stream token: what was computed and how long since the stream's previous token."""

    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # wall time
    cpu_seconds: list[float] = field(default_factory=list)  # the engine thread's CPU time
    work: list[int] = field(default_factory=list)  # per step: prompt tokens + images' tokens
    encoded: list[int] = field(default_factory=list)  # per step: images encoded


class Recording:
    def __init__(self, engine: LLMEngine) -> None:
        self.plans: list[StepPlan] = []
        self.engine, self._execute = engine, engine.executor.execute
        engine.executor.execute = self  # type: ignore[method-assign]

    def __call__(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        return self._execute(plan)

    def close(self) -> None:
        self.engine.executor.execute = self._execute  # type: ignore[method-assign]


def record(gaps: Gaps, plan: StepPlan, wall: float, cpu: float) -> None:
    gaps.tokens += [plan.num_tokens] * STREAMS
    gaps.seconds += [wall] * STREAMS
    gaps.cpu_seconds += [cpu] * STREAMS
    images = sum(e.image.num_tokens(FACTOR) for e in plan.encoder_inputs)
    gaps.work.append(plan.num_tokens - STREAMS + images)
    gaps.encoded.append(len(plan.encoder_inputs))


def measure(engine: LLMEngine, with_images: bool, seed: int) -> Gaps:
    """8 streams decode; with_images, the 4-image request comes at the window's second step
    (its pixels drawn from `seed`: no prefix-cache hit on an earlier run's images)."""
    tok, recording = build_tokenizer(1024), Recording(engine)
    streams = [
        engine.add_request(prompt(tok, [("user", [f"Stream {i} says hi."])])[0], STREAM)
        for i in range(STREAMS)
    ]
    started: set[str] = set()
    while len(started) < STREAMS:
        started |= {o.request_id for o in engine.step() if o.token_ids}
    # The request's pixels and digests are made before the window: the service makes them on
    # the replica's worker thread (deployments/frontend/images/mm_prompt.py), never on the engine
    # loop.
    ids, images = prompt(tok, [("user", [LARGE, LARGE, "Four:", LARGE, LARGE])])
    inputs = engine_images(images, pixels(images, seed))
    assert all(image.digest < 0 for image in inputs)
    gaps, wall, cpu = Gaps(), time.perf_counter(), time.thread_time()
    for step in range(WINDOW):
        if step == 1 and with_images:
            engine.add_request(ids, ONE, images=inputs)
        outs = {o.request_id for o in engine.step()}
        assert all(r in outs for r in streams), "every stream gets a token every step"
        record(gaps, recording.plans[-1], time.perf_counter() - wall, time.thread_time() - cpu)
        wall, cpu = time.perf_counter(), time.thread_time()
    for r in streams:
        engine.abort_request(r)
    recording.close()
    assert not engine.has_unfinished()
    return gaps


def p99(values: list) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def steady_p99(runs: list[Gaps], kind: str) -> float:
    """p99 over the window of each gap at its least across repeated runs: the runs take the
    same steps, and a burst of other work slows one run's step, seldom all of them."""
    return p99([min(s) for s in zip(*(getattr(g, kind) for g in runs), strict=True)])


def test_four_large_images_do_not_stall_eight_streams(engine: LLMEngine) -> None:
    measure(engine, True, seed=0)  # warm-up: first-use allocations are not the images' doing
    runs: dict[bool, list[Gaps]] = {False: [], True: []}
    for seed in range(1, 1 + REPEATS):  # interleaved: both kinds see the machine's same moods
        for kind in (False, True):
            runs[kind].append(measure(engine, kind, seed))
    base, images = runs[False][0], runs[True][0]
    assert sum(images.encoded) == 4, "the image request was prefilled in the window"
    # Each step's prompt tokens and encoder work (an image costs its tokens) stay in the cap,
    # but for a step that starts on an image: that image and one token.
    assert max(base.work) == 0 and max(images.encoded) == 1
    large = sum(tokens_of(g) for g in LARGE.grids)
    assert all(
        w <= CAP or (e, w) == (1, 1 + large)
        for w, e in zip(images.work, images.encoded, strict=True)
    )
    assert max(base.tokens) == STREAMS and max(images.tokens) <= STREAMS + CAP
    walls = [steady_p99(runs[k], "seconds") * 1e3 for k in (False, True)]
    cpus = [steady_p99(runs[k], "cpu_seconds") * 1e3 for k in (False, True)]
    print(f"p99 gap without / with the images: wall {walls[0]:.2f} / {walls[1]:.2f} ms, ", end="")
    print(f"CPU {cpus[0]:.2f} / {cpus[1]:.2f} ms")
    assert cpus[1] <= 2 * cpus[0]
