"""No decode stalls from prefill: while long prompts are admitted, a running stream gets a token
every step, and the tokens computed between two of its tokens stay under a bound (counted,
not timed): one decode row per stream plus `max_prefill_tokens_while_decoding`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.configs.config import CPU_PREFILL_TOKENS_WHILE_DECODING, EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.plan import StepPlan, StepResult
from shortconv.engine.request import Request
from shortconv.engine.scheduler import Scheduler, SchedulerConfig
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

STREAM = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def scheduler(budget: int, cap: int) -> Scheduler:
    cfg = SchedulerConfig(
        8, budget, max_model_len=1024, page_size=8, max_prefill_tokens_while_decoding=cap
    )
    return Scheduler(cfg, SlotAllocator(17), PageAllocator(512))


def step(s: Scheduler) -> StepPlan:
    plan = s.schedule()
    assert plan is not None
    rows = tuple(c.request_id for c in plan.seqs if c.sampling is not None)
    n = len(rows)
    s.update(plan, StepResult(plan.step_id, rows, (7,) * n, (None,) * n, (None,) * n))
    return plan


def gaps_while_prompts_arrive(s: Scheduler) -> list[int]:
    """Tokens per step of the stream `a` while two long prompts prefill behind it."""
    s.add(Request("a", [5, 6, 7], STREAM, seed=0))
    step(s)  # a's prompt: it decodes from now on
    s.add(Request("long1", list(range(10, 410)), ONE, seed=0))
    s.add(Request("long2", list(range(10, 310)), ONE, seed=0))
    gaps = []
    while any(r in s.requests for r in ("long1", "long2")):
        plan = step(s)
        assert plan.seqs[0].request_id == "a" and plan.seqs[0].num_tokens == 1  # decode first
        gaps.append(plan.num_tokens)
    return gaps


def test_the_cap_bounds_every_step_a_stream_decodes_in() -> None:
    gaps = gaps_while_prompts_arrive(scheduler(budget=256, cap=16))
    assert max(gaps) <= 1 + 16
    assert len(gaps) >= (400 + 300) // 16  # both prompts went through, 16 tokens a step


def test_without_a_cap_prompts_fill_the_budget() -> None:
    """The bound above is the cap's doing: with none, steps carry the whole budget."""
    gaps = gaps_while_prompts_arrive(scheduler(budget=256, cap=0))
    assert max(gaps) == 256


def test_nothing_decoding_prefills_with_the_whole_budget() -> None:
    s = scheduler(budget=256, cap=16)
    s.add(Request("long", list(range(10, 410)), ONE, seed=0))
    assert step(s).num_tokens == 256


def test_cap_default_follows_the_device() -> None:
    cfg = EngineConfig(max_num_batched_tokens=512)
    assert (
        cfg.prefill_tokens_while_decoding(torch.device("cpu")) == CPU_PREFILL_TOKENS_WHILE_DECODING
    )
    assert cfg.prefill_tokens_while_decoding(torch.device("cuda")) == 0  # the whole budget
    assert (
        EngineConfig(max_prefill_tokens_while_decoding=64).prefill_tokens_while_decoding(
            torch.device("cpu")
        )
        == 64
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=3)


class Counting:
    """Wraps the executor's execute: the tokens each step computed."""

    def __init__(self, engine: LLMEngine) -> None:
        self.tokens: list[int] = []
        self._execute = engine.executor.execute
        engine.executor.execute = self  # type: ignore[method-assign]

    def __call__(self, plan: StepPlan) -> StepResult:
        self.tokens.append(plan.num_tokens)
        return self._execute(plan)


def test_engine_stream_gap_stays_bounded_while_a_long_prompt_is_admitted(ckpt: Path) -> None:
    """The real engine at its CPU defaults (budget 512): the tokens computed between two of a
    stream's tokens stay within one decode row plus the CPU cap while a 400-token prompt and
    then another are admitted."""
    engine = build_engine(ckpt, dtype="float32", engine_config=EngineConfig())
    counting = Counting(engine)
    rid = engine.add_request([5, 6, 7], STREAM)
    seen, computed, gaps = 0, 0, []
    for i in range(30):
        if i in (2, 6):  # two different prompts: no prefix-cache hit shortens the second
            engine.add_request(list(range(10 + i, 410 + i)), ONE)
        outs = {o.request_id: o for o in engine.step()}
        computed += counting.tokens[-1]
        n = len(outs[rid].token_ids) if rid in outs else seen
        if n > seen:
            if seen:
                gaps.append(computed)
            seen, computed = n, 0
    assert len(gaps) >= 25 and max(gaps) <= 1 + CPU_PREFILL_TOKENS_WHILE_DECODING + 1
    assert sum(counting.tokens) > 800  # both long prompts were prefilled meanwhile
