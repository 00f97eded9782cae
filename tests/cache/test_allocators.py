"""Slot and page bookkeeping invariants: scratch never handed out, no double free, no leak."""

from __future__ import annotations

import random

import pytest

from shortconv.cache.allocators import (
    SCRATCH_PAGE,
    SCRATCH_SLOT,
    AllocatorError,
    PageAllocator,
    SlotAllocator,
)


def test_slots_never_hand_out_scratch_and_are_unique():
    a = SlotAllocator(8)
    got = [a.alloc() for _ in range(7)]
    assert SCRATCH_SLOT not in got and len(set(got)) == 7
    assert a.alloc() is None and a.num_free == 0 and a.num_used == 7


def test_slot_double_free_and_foreign_free_raise():
    a = SlotAllocator(4)
    s = a.alloc()
    a.free(s)
    with pytest.raises(AllocatorError):
        a.free(s)
    with pytest.raises(AllocatorError):
        a.free(SCRATCH_SLOT)


def test_slot_random_churn_keeps_invariants():
    rng = random.Random(0)
    a = SlotAllocator(16)
    live: set[int] = set()
    for _ in range(2000):
        if live and rng.random() < 0.5:
            s = rng.choice(sorted(live))
            live.remove(s)
            a.free(s)
        else:
            s = a.alloc()
            if s is None:
                assert len(live) == a.capacity
                continue
            assert s not in live and s != SCRATCH_SLOT
            live.add(s)
        assert a.num_used == len(live) and a.num_free + a.num_used == a.capacity
    for s in list(live):
        a.free(s)
    assert a.num_free == a.capacity


def test_pages_all_or_nothing_and_refcounts():
    p = PageAllocator(6)
    assert p.alloc(6) is None and p.num_free == 5
    pages = p.alloc(3)
    assert SCRATCH_PAGE not in pages
    p.share(pages[:2])
    p.free(pages)
    assert p.num_used == 2 and p.refcount(pages[0]) == 1 and p.refcount(pages[2]) == 0
    p.free(pages[:2])
    assert p.num_free == p.capacity
    with pytest.raises(AllocatorError):
        p.free(pages[:1])
