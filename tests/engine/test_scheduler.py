"""Scheduler: token budgets, chunked prefill, mixed steps, max_num_seqs, preemption, release."""

from __future__ import annotations

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.engine.plan import StepPlan, StepResult
from shortconv.engine.request import Request, Status
from shortconv.engine.scheduler import Scheduler, SchedulerConfig
from shortconv.sampling.sampling_params import SamplingParams

P = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make(
    budget: int = 8, seqs: int = 4, slots: int = 9, pages: int = 64, page: int = 4
) -> Scheduler:
    cfg = SchedulerConfig(seqs, budget, max_model_len=256, page_size=page, eos_token_ids=(2,))
    return Scheduler(cfg, SlotAllocator(slots), PageAllocator(pages))


def held(s: Scheduler) -> tuple[int, int]:
    """Slots and pages in use."""
    return s.cache_manager.slots.num_used, s.cache_manager.pages.num_used


def fake_result(plan: StepPlan, token: int = 7) -> StepResult:
    ids = tuple(rid for s in plan.seqs for rid, _ in s.samples)
    n = len(ids)
    return StepResult(plan.step_id, ids, (token,) * n, (None,) * n, (None,) * n)


def run_step(s: Scheduler, token: int = 7) -> StepPlan | None:
    plan = s.schedule()
    if plan is not None:
        s.update(plan, fake_result(plan, token))
    return plan


def req(rid: str, n: int, params: SamplingParams = P) -> Request:
    return Request(rid, list(range(10, 10 + n)), params, seed=0)


def test_chunked_prefill_respects_budget_and_samples_only_at_prompt_end():
    s = make(budget=8)
    s.add(req("a", 20))
    sizes, sampled = [], []
    for _ in range(3):
        plan = run_step(s)
        sizes.append(plan.num_tokens)
        sampled.append(plan.seqs[0].sampling is not None)
        assert plan.seqs[0].has_initial_state == (sizes[:-1] != [])
    assert sizes == [8, 8, 4] and sampled == [False, False, True]
    assert s.requests["a"].output_token_ids == [7]


def test_decode_and_prefill_share_a_step():
    s = make(budget=8)
    s.add(req("a", 3))
    run_step(s)  # a prefilled, now decoding
    s.add(req("b", 30))
    plan = run_step(s)
    assert [c.request_id for c in plan.seqs] == ["a", "b"]
    assert plan.seqs[0].num_tokens == 1 and plan.seqs[1].num_tokens == 7
    assert plan.num_tokens <= 8


def test_max_num_seqs_bounds_running():
    s = make(budget=64, seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", 3))
    plan = run_step(s)
    assert len(plan.seqs) == 2 and len(s.waiting) == 2


def test_finish_releases_slots_and_pages():
    s = make()
    for i in range(3):
        s.add(req(f"r{i}", 5))
    while s.has_unfinished():
        run_step(s)
    assert held(s) == (0, 0) and not s.requests


def test_eos_and_stop_token_ids_finish():
    s = make()
    s.add(req("a", 3, SamplingParams(temperature=0.0, max_tokens=50)))
    run_step(s, token=2)
    assert not s.has_unfinished() and held(s)[0] == 0
    s.add(req("b", 3, SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=(9,))))
    run_step(s, token=9)
    assert not s.has_unfinished()


def test_abort_releases_everything_in_every_state():
    s = make(budget=4)
    s.add(req("running", 10))
    s.add(req("waiting", 10))
    run_step(s)  # "running" holds a slot and pages mid-prefill
    assert held(s)[0] == 1 and held(s)[1] > 0
    s.abort("running")
    s.abort("waiting")
    assert held(s) == (0, 0) and not s.has_unfinished()
    assert s.abort("unknown") is None


def test_preemption_frees_and_recomputes():
    # 7 usable pages of 4 tokens; two requests that each grow to 12+ tokens cannot both fit.
    s = make(budget=64, pages=8, page=4)
    long = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    s.add(req("old", 10, long))
    s.add(req("new", 10, long))
    preempted = False
    for _ in range(200):
        if not s.has_unfinished():
            break
        run_step(s)
        r = s.requests.get("new")
        if r is not None and r.num_preemptions:
            preempted = True
            assert r.status is Status.RUNNING or r.slot is None
        used = sum(len(x.pages) for x in s.requests.values())
        assert used == held(s)[1]  # every allocated page belongs to a live request
    assert preempted and not s.has_unfinished()
    assert held(s) == (0, 0)


def test_preempted_request_replays_prompt_and_outputs():
    s = make(budget=64, pages=8, page=4)
    r = req("x", 6)
    s.add(r)
    run_step(s)
    run_step(s)
    s._preempt(r)
    plan = s.schedule()
    chunk = plan.seqs[0]
    assert chunk.start_pos == 0 and list(chunk.token_ids) == r.prompt_token_ids + [7, 7]
    assert chunk.sampling is not None and chunk.sampling.step == 2


def test_a_forking_parent_samples_every_fork_from_its_last_chunk():
    """n=3 over a 10-token prompt (a partly filled last page): the parent's chunks cover the
    whole prompt, its last one carries one row per fork (each its own seed) and no row of its
    own; next step each fork is a decode row at position 10 on a copy of the parent's state."""
    s = make(budget=8, seqs=3)
    s.add(req("a", 10, SamplingParams(temperature=1.0, max_tokens=3, n=3)))
    first, last = run_step(s), run_step(s)
    assert [c.num_tokens for c in (*first.seqs, *last.seqs)] == [8, 2]
    (chunk,) = last.seqs
    assert chunk.sampling is None and first.seqs[0].fork_rows == ()
    assert [rid for rid, _ in chunk.fork_rows] == ["a/0", "a/1", "a/2"]
    assert len({row.seed for _, row in chunk.fork_rows}) == 3
    parent = s.requests["a"]
    assert parent.status is Status.FORKING and parent.num_computed == 10
    assert [f.output_token_ids for f in parent.forks] == [[7]] * 3
    source = parent.slot
    forks = run_step(s)
    assert [(c.request_id, c.start_pos, c.token_ids) for c in forks.seqs] == [
        (f"a/{i}", 10, (7,)) for i in range(3)
    ]
    assert {src for src, _ in forks.copies_before} == {source}
    assert parent.slot is None  # copied by all: the parent's slot and pages went back
    assert len(forks.page_copies) == 3  # each fork's copy of the partly filled page
    while s.has_unfinished():
        run_step(s)
    assert held(s) == (0, 0) and not s.requests
