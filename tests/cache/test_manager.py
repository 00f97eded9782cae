"""The cache manager alone (no model): sessions are pins with and without prefix caching, every
exit path gives slots and pages back, and an expired session's pages come back."""

from __future__ import annotations

import itertools
import time

import pytest

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.manager import CacheManager, StepCopies
from shortconv.engine.request import Request
from shortconv.sampling.sampling_params import SamplingParams

PS = 4
P = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [1, 2, 3, 4, 5, 6]
_ids = itertools.count()


def manager(caching: bool) -> CacheManager:
    return CacheManager(
        SlotAllocator(16),
        PageAllocator(32),
        PS,
        prefix_caching=caching,
        checkpoint_interval=PS,
        session_ttl_s=60.0,
    )


def held(cm: CacheManager) -> tuple[int, int]:
    return cm.slots.num_used, cm.pages.num_used


def step(cm: CacheManager, req: Request, n: int) -> None:
    """Plan and 'run' one chunk of n tokens."""
    assert cm.grow(req, req.num_computed + n)
    cm.plan_checkpoints(req, req.num_computed, n, StepCopies())
    req.num_computed += n
    cm.commit_checkpoints(req)


def turn(
    cm: CacheManager, prompt: list[int], session: str | None = None, answer: tuple = (7, 8)
) -> Request:
    """A whole request: prefill in one chunk, decode `answer`, finish normally."""
    req = Request(f"r{next(_ids)}", list(prompt), P, seed=0, session_id=session)
    n = cm.admit(req, 1000, StepCopies())
    for tok in answer:
        step(cm, req, n)
        req.output_token_ids.append(tok)
        n = 1
    cm.finish(req, completed=True)
    return req


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_a_session_pins_its_checkpoints_and_its_next_turn_resumes(caching: bool) -> None:
    cm = manager(caching)
    turn(cm, PROMPT, "s")
    gen = PROMPT + [7]  # the last sampled token was never fed back
    assert "s" in cm.sessions and cm.tree.find(PROMPT).pins == cm.tree.find(gen).pins == 1
    again = turn(cm, gen + [8, 9], "s")
    assert again.num_cached_tokens == len(gen)
    # The pins moved to the new turn's checkpoints; without prefix caching the old ones went.
    old = cm.tree.find(PROMPT)
    assert (old is not None and old.pins == 0) if caching else old is None
    assert len(cm.sessions) == 1 and cm.sessions.hits == 1 and cm.sessions.misses == 1


def test_without_prefix_caching_only_a_sessions_own_pins_resume() -> None:
    cm = manager(False)
    turn(cm, PROMPT, "a")
    follow_up = PROMPT + [7, 9]
    assert turn(cm, follow_up, "b").num_cached_tokens == 0  # another session's checkpoint
    assert turn(cm, follow_up).num_cached_tokens == 0  # no session: nothing reused, nor kept
    assert turn(cm, follow_up, "a").num_cached_tokens == len(PROMPT) + 1
    assert cm.sessions.session_ids() == ["b", "a"]
    cm.sessions.drop("a")
    cm.sessions.drop("b")
    assert held(cm) == (0, 0)


def test_with_prefix_caching_any_request_resumes_and_leaves_its_checkpoints() -> None:
    cm = manager(True)
    turn(cm, PROMPT)
    assert not cm.sessions and cm.tree.num_checkpoints == 3  # at 4, end of prompt, end of gen
    assert turn(cm, PROMPT + [7, 9], "new").num_cached_tokens == len(PROMPT) + 1
    assert cm.flush() > 0 and held(cm) == (0, 0) and not cm.sessions


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_abort_mid_prefill_and_after_the_prompt_frees_everything(caching: bool) -> None:
    cm = manager(caching)
    req = Request("x", list(range(1, 12)), P, seed=0, session_id="s")
    n = cm.admit(req, 6, StepCopies())
    cm.plan_checkpoints(req, 0, n, StepCopies())  # the step that would write them never ran
    assert req.slot is not None and req.pages
    cm.finish(req, completed=False)
    assert held(cm) == (0, 0) and not req.pending_ckpts and req.slot is None
    req = Request("y", list(range(1, 12)), P, seed=0, session_id="s")
    step(cm, req, cm.admit(req, 1000, StepCopies()))  # the whole prompt: its end checkpointed
    assert req.prompt_entry is not None
    cm.finish(req, completed=False)
    assert "s" not in cm.sessions and req.slot is None and not req.pages
    cm.flush()  # with prefix caching the unpinned checkpoints stay until evicted or flushed
    assert held(cm) == (0, 0)


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_an_expired_sessions_pages_come_back(caching: bool) -> None:
    cm = manager(caching)
    turn(cm, PROMPT, "s")
    assert held(cm)[1] > 0 and cm.evict_idle() == 0
    assert cm.sessions.evict_idle(now=time.monotonic() + 61) == 1
    assert "s" not in cm.sessions and cm.sessions.evictions == 1
    if caching:  # the checkpoints stay as ordinary entries, evictable like any other
        assert cm.tree.find(PROMPT).pins == 0 and cm.flush() > 0
    assert held(cm) == (0, 0)


def test_a_pinned_checkpoint_evicted_under_pressure_unpins_its_session() -> None:
    cm = manager(False)
    turn(cm, PROMPT, "s")
    while cm.tree.evict("slot"):  # what a live request short of slots does
        pass
    assert "s" not in cm.sessions and cm.sessions.evictions == 1 and held(cm) == (0, 0)


def test_keeping_the_same_checkpoint_again_keeps_it() -> None:
    cm = manager(False)
    turn(cm, PROMPT, "s")
    entry = cm.tree.find(PROMPT)
    cm.sessions.keep("s", [entry])  # a turn whose checkpoints are the previous turn's own
    assert entry.slot is not None and entry.pins == 1 and cm.sessions.holds("s", entry)
    assert cm.tree.find(PROMPT + [7]) is None  # the one no longer pinned went
