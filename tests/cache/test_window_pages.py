"""Sliding-window KV groups in the cache manager: pages freed behind the window, all-or-nothing
growth across groups, checkpoints that keep their window's pages, and hits that never resume
from a window whose pages are gone (synthetic groups: window 8, pages of 4 tokens)."""

from __future__ import annotations

import itertools

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.kv_groups import first_live_page, window_page_bound
from shortconv.cache.manager import CacheManager, StepCopies
from shortconv.cache.prefix_cache import PrefixCache
from shortconv.cache.window_pages import WindowGroup, window_span
from shortconv.engine.request import Request
from shortconv.sampling.sampling_params import SamplingParams

PS, W = 4, 8
BOUND = window_page_bound(W, PS)  # 3
P = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
_ids = itertools.count()


def manager(caching: bool, window_pages: int = 64, slots: int = 16) -> CacheManager:
    return CacheManager(
        SlotAllocator(slots),
        PageAllocator(64),
        PS,
        prefix_caching=caching,
        checkpoint_interval=PS,
        session_ttl_s=60.0,
        windows=(WindowGroup(W, PageAllocator(window_pages)),),
    )


def request(prompt: list[int]) -> Request:
    return Request(f"r{next(_ids)}", list(prompt), P, seed=0)


def run(cm: CacheManager, req: Request, n: int) -> None:
    """Plan and 'run' one chunk of n tokens (the request is admitted already)."""
    assert cm.grow(req, req.num_computed + n)
    cm.plan_checkpoints(req, req.num_computed, n, StepCopies())
    req.num_computed += n
    cm.commit_checkpoints(req)


def live(table: list[int]) -> list[int]:
    return [p for p in table if p]


def window_used(cm: CacheManager) -> int:
    return cm.windows[0].pages.num_used


def test_decode_to_eight_windows_keeps_at_most_the_window_bound() -> None:
    cm = manager(caching=False)
    req = request([3, 4, 5, 6, 7])
    n = cm.admit(req, 1000, StepCopies())
    run(cm, req, n)
    most = 0
    while req.num_computed < 8 * W:
        run(cm, req, 1)
        table = req.window_pages[0]
        first = first_live_page(req.num_computed - 1, W, PS)
        assert all(p == 0 for p in table[:first]) and 0 not in table[first:]
        assert len(live(table)) == window_used(cm) <= BOUND
        most = max(most, window_used(cm))
        assert len(req.pages) == -(-req.num_computed // PS) == cm.pages.num_used  # full: all
    assert most == BOUND  # a window that straddles pages does hold one more
    cm.finish(req, completed=False)
    assert window_used(cm) == 0 and cm.pages.num_used == 0 and cm.slots.num_used == 0


def test_a_chunk_keeps_the_window_before_it_and_frees_only_wholly_older_pages() -> None:
    cm = manager(caching=False)
    req = request(list(range(3, 60)))
    cm.admit(req, 10, StepCopies())
    for start, n in [(0, 10), (10, 7), (17, 13), (30, 1), (31, 9)]:
        assert req.num_computed == start
        assert cm.grow(req, start + n)
        table = req.window_pages[0]
        # Pages from the one holding position start - W + 1 to the chunk's last are live.
        keep = range(first_live_page(start, W, PS), -(-(start + n) // PS))
        assert [i for i, p in enumerate(table) if p] == list(keep)
        assert (start - W + 1) < (keep.start + 1) * PS  # the first kept page is still read
        req.num_computed += n


def test_growth_is_all_or_nothing_across_groups() -> None:
    """A window group too small for the chunk refuses the admission: nothing held anywhere."""
    cm = manager(caching=False, window_pages=3)  # 2 live pages: a 12-token chunk needs 3
    req = request(list(range(3, 20)))
    assert cm.admit(req, 12, StepCopies()) == 0
    assert (cm.slots.num_used, cm.pages.num_used, window_used(cm)) == (0, 0, 0)
    assert cm.admit(req, 8, StepCopies()) == 8  # 2 pages per group fit


def test_prefix_hit_shares_the_window_and_copies_its_partial_page() -> None:
    cm = manager(caching=True)
    prompt = list(range(3, 16))  # 13 tokens: the end-of-prompt checkpoint is mid-page
    owner = request(prompt)
    n = cm.admit(owner, 1000, StepCopies())
    run(cm, owner, n)
    cm.finish(owner, completed=False)  # aborted: its end-of-prompt checkpoint stays cached
    entry = cm.tree.find(prompt)
    assert entry is not None and entry.slot is not None
    span = window_span(13, W, PS)
    assert len(entry.windows[0]) == len(span) == 3  # pages 1..3 cover [6, 13)
    *shared, partial = entry.windows[0]
    refs = cm.windows[0].pages.refcount
    before = [refs(p) for p in entry.windows[0]]
    req = request(prompt + [20, 21])
    copies = StepCopies()
    cm.admit(req, 1000, copies)
    assert req.num_cached_tokens == 13
    table = req.window_pages[0]
    assert table[: span.start] == [0] * span.start
    assert table[span.start : span.stop - 1] == shared
    assert [refs(p) for p in entry.windows[0]] == [n + 1 for n in before[:-1]] + before[-1:]
    assert table[span.stop - 1] != partial  # written past position 13: a copy of its own
    assert (req.request_id, 1, partial, table[span.stop - 1]) in copies.pages
    assert (req.request_id, 0, entry.page, req.pages[-1]) in copies.pages


def test_a_checkpoint_whose_window_pages_were_freed_is_never_matched() -> None:
    slots, pages, window = SlotAllocator(8), PageAllocator(16), PageAllocator(16)
    tree = PrefixCache(PS, slots, pages, windows=(WindowGroup(W, window),))
    tokens = list(range(3, 23))  # 20 tokens: a resume at 20 reads pages 3 and 4
    full = pages.alloc(5)
    moved_on = [0, 0, 0, 0, *window.alloc(1)]  # its next chunk starts at 23: page 3 is gone
    assert tree.insert(tokens, full, slots.alloc(), [moved_on]) is None
    assert slots.num_used == 0 and tree.match(tokens + [1]) is None
    earlier = [0, 0, *window.alloc(2), moved_on[4]]  # the same request when it was at 16
    assert tree.insert(tokens[:12], full, slots.alloc(), [earlier]) is None  # page 1 gone
    assert tree.insert(tokens[:16], full, slots.alloc(), [earlier]) is not None
    hit = tree.match(tokens + [1])
    assert hit is not None and hit.num_tokens == 16  # the checkpoint whose window lives
    assert hit.windows == (tuple(earlier[2:4]),)
    assert tree.insert(tokens, full, slots.alloc(), []) is None  # no window tables at all


def test_window_page_pressure_evicts_checkpoints_and_their_windows_go() -> None:
    """A live request that needs window pages evicts cached checkpoints (with their windows);
    the evicted entry's prompt then finds no hit."""
    cm = manager(caching=True, window_pages=7)
    first = list(range(3, 19))  # 16 tokens: checkpoints at 4, 8, 12, 16
    owner = request(first)
    run(cm, owner, cm.admit(owner, 1000, StepCopies()))
    cm.finish(owner, completed=False)
    held = window_used(cm)
    assert held > 0 and cm.tree.num_checkpoints == 4
    other = request(list(range(100, 124)))  # needs 6 window pages for its one chunk
    assert cm.admit(other, 1000, StepCopies()) == 24
    assert window_used(cm) <= 6 + held and cm.tree.num_checkpoints < 4
    for entry in [cm.tree.find(first[:q]) for q in (4, 8, 12, 16)]:
        assert entry is None or entry.slot is None or len(entry.windows) == 1
    cm.finish(other, completed=False)
    cm.flush()
    assert (cm.slots.num_used, cm.pages.num_used, window_used(cm)) == (0, 0, 0)


def test_sessions_resume_with_the_window_and_release_everything() -> None:
    cm = manager(caching=False)
    prompt = list(range(3, 30))
    req = Request("a", prompt, P, seed=0, session_id="s")
    run(cm, req, cm.admit(req, 1000, StepCopies()))
    for tok in (40, 41, 42):
        req.output_token_ids.append(tok)
        run(cm, req, 1)
    cm.finish(req, completed=True)
    turn2 = Request("b", prompt + [40, 41, 42, 43, 44], P, seed=0, session_id="s")
    n = cm.admit(turn2, 1000, StepCopies())
    assert turn2.num_cached_tokens == 30 and n == 2
    assert live(turn2.window_pages[0]) and turn2.window_pages[0][0] == 0
    cm.finish(turn2, completed=False)
    cm.sessions.drop("s")
    assert (cm.slots.num_used, cm.pages.num_used, window_used(cm)) == (0, 0, 0)
