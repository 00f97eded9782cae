"""Grammar masks are made where the scheduler decides the step (issue #45): the plan the
executor runs is the very object `Scheduler.schedule` returned (nothing rebuilds it after the
decision), and every constrained row in it already carries its mask, the one an independent
matcher gives after the request's tokens so far (a verify row's position i: its proposals
0..i-1 too; a fork's first row: none)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from test_spec_grammar import CASES, SHOWN, SPEC, engine

from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.plan import StepPlan, StepResult
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

xgr = pytest.importorskip("xgrammar")

# (plan the executor got, each live request's output tokens when it got it)
_Executed = tuple[StepPlan, dict[str, list[int]]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("grammar_plan"), seed=3)


def record(
    eng: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[StepPlan], list[_Executed]]:
    """Spies on the plans the scheduler returns and the plans the executor runs."""
    scheduled: list[StepPlan] = []
    executed: list[_Executed] = []
    schedule, execute = eng.scheduler.schedule, eng.executor.execute

    def scheduling() -> StepPlan | None:
        plan = schedule()
        if plan is not None:
            scheduled.append(plan)
        return plan

    def executing(plan: StepPlan) -> StepResult:
        live = {rid: list(r.output_token_ids) for rid, r in eng.scheduler.requests.items()}
        executed.append((plan, live))
        return execute(plan)

    monkeypatch.setattr(eng.scheduler, "schedule", scheduling)
    monkeypatch.setattr(eng.executor, "execute", executing)
    return scheduled, executed


def expected_mask(compiled: object, tokens: Sequence[int], vocab: int) -> bytes:
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in tokens)
    mask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask)
    return mask.numpy()[0].tobytes()


def test_the_executor_runs_the_scheduled_plan_with_its_masks_in_it(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grammar, _ = CASES["json_schema"]
    eng = engine(ckpt, SPEC)
    scheduled, executed = record(eng, monkeypatch)
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, grammar=grammar),
        SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=30, grammar=grammar),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    ]
    prompts = [f"Answer like {SHOWN}: ", f"Again {SHOWN}", "free text 1 2 1 2 1 2"]
    for text, p in zip(prompts, params, strict=True):
        eng.add_request(eng.encode_prompt(text), p)
    while eng.has_unfinished():
        assert all(out.error is None for out in eng.step())

    # One plan per step: the executor's is the scheduler's own object, never a rebuilt copy.
    ran = [s for s in scheduled if s.seqs]
    assert ran and len(executed) == len(ran)
    assert all(got is built for (got, _), built in zip(executed, ran, strict=True))

    compiled = eng.grammars.cache.get(grammar)
    vocab = eng.model_cfg.vocab_size
    kinds = set()
    for plan, live in executed:
        for chunk in plan.seqs:
            proposals = chunk.token_ids[1:] if chunk.num_draft else ()
            for i, (rid, row) in enumerate(chunk.samples):
                if row.params.grammar is None:
                    assert row.token_mask is None
                    continue
                tokens = [*live[rid], *proposals[:i]]
                assert row.token_mask == expected_mask(compiled, tokens, vocab), (rid, i)
                kinds.add("verify" if chunk.num_draft else "fork" if chunk.fork_rows else "row")
    assert kinds == {"verify", "fork", "row"}, kinds
