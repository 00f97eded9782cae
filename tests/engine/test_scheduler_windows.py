"""The scheduler with a sliding-window KV group: admission counts each group's pages, and a
running request's window shrinking behind it makes room for the next one."""

from __future__ import annotations

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.window_pages import WindowGroup
from shortconv.engine.plan import StepPlan, StepResult
from shortconv.engine.request import Request
from shortconv.engine.scheduler import Scheduler, SchedulerConfig
from shortconv.sampling.sampling_params import SamplingParams

P = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def result(plan: StepPlan) -> StepResult:
    ids = tuple(s.request_id for s in plan.seqs if s.sampling is not None)
    n = len(ids)
    return StepResult(plan.step_id, ids, (7,) * n, (None,) * n, (None,) * n)


def test_admission_waits_on_the_window_group_then_its_freed_pages_admit() -> None:
    cfg = SchedulerConfig(4, 64, max_model_len=256, page_size=4)
    window = WindowGroup(8, PageAllocator(1 + 6))  # 6 live pages; the full group has 63
    s = Scheduler(cfg, SlotAllocator(9), PageAllocator(64), (window,))
    a, b = Request("a", list(range(3, 19)), P, 0), Request("b", list(range(3, 15)), P, 0)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan is not None and [c.request_id for c in plan.seqs] == ["a"]  # b needs 3 more
    assert plan.seqs[0].window_tables == (tuple(a.window_pages[0]),)
    assert window.pages.num_used == 4 and s.cache_manager.pages.num_free > 50
    s.update(plan, result(plan))
    plan = s.schedule()  # a decodes at 16: pages 0 and 1 are wholly before 16 - 8 + 1
    assert plan is not None and [c.request_id for c in plan.seqs] == ["a", "b"]
    assert a.window_pages[0][:2] == [0, 0] and window.pages.num_used == 3 + 3
    s.update(plan, result(plan))
    for req in (a, b):
        s.abort(req.request_id)
    assert window.pages.num_used == 0 and s.cache_manager.pages.num_used == 0
