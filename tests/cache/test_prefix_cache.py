"""PrefixCache on its own (pure Python): lookups, references, eviction order, pins, flush."""

from __future__ import annotations

import pytest

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.prefix_cache import PrefixCache
from shortconv.cache.sessions import SessionPins

PS = 4


def make(slots: int = 16, pages: int = 16) -> PrefixCache:
    return PrefixCache(PS, SlotAllocator(slots), PageAllocator(pages))


def checkpoint(cache: PrefixCache, tokens: list[int], reuse: tuple[int, ...] = ()) -> list[int]:
    """Insert a checkpoint after `tokens` as a request would: it holds a reference on the
    cached pages it `reuse`s and fresh pages for the rest, hands its slot to the cache and
    releases its pages (the cache keeps its own references)."""
    cache.pages.share(list(reuse))
    pages = list(reuse) + cache.pages.alloc(-(-len(tokens) // PS) - len(reuse))
    slot = cache.slots.alloc()
    cache.insert(tokens, pages, slot)
    cache.pages.free(pages)
    return pages


def test_match_takes_the_deepest_checkpoint_short_of_the_end() -> None:
    cache = make()
    seq = list(range(10, 20))
    pages = checkpoint(cache, seq[:8])  # page-aligned, two pages
    checkpoint(cache, seq[:10], tuple(pages))  # mid-page tail in page 3
    hit = cache.match(seq + [99])
    assert hit is not None and hit.num_tokens == 10 and hit.partial_page is not None
    assert hit.full_pages == tuple(pages)
    assert cache.match(seq).num_tokens == 8  # a whole earlier prompt: not at its own end
    assert cache.match(seq[:9]).num_tokens == 8
    assert cache.match(seq[:8]) is None  # ... and nothing before 8
    assert cache.match([10, 11, 12, 13, 14, 15, 16, 0, 1]) is None  # diverges inside page 2
    assert cache.find(seq[:10]) is not None and cache.find(seq[:9]) is None


def test_duplicate_checkpoint_frees_its_slot_and_takes_no_extra_page_refs() -> None:
    cache = make()
    seq = list(range(8))
    pages = checkpoint(cache, seq)
    used = cache.slots.num_used
    checkpoint(cache, seq)  # the same prefix computed again in other pages
    assert cache.slots.num_used == used and cache.num_checkpoints == 1
    assert [cache.pages.refcount(p) for p in pages] == [1, 1]
    assert cache.pages.num_used == 2  # the duplicate's pages went back


def test_eviction_is_lru_leaves_first_and_spares_what_a_request_holds() -> None:
    cache = make()
    old = checkpoint(cache, [1, 2, 3, 4])
    new = checkpoint(cache, [5, 6, 7, 8])
    cache.match([5, 6, 7, 8, 9])  # touch: [1..4] is now the least recently used
    held = cache.match([1, 2, 3, 4, 0])
    assert held is not None
    cache.pages.share(list(held.full_pages))  # a running request resumed from it ...
    cache.match([5, 6, 7, 8, 9])
    assert cache.evict("page")
    assert cache.find([1, 2, 3, 4]) is None and cache.find([5, 6, 7, 8]) is not None
    assert cache.pages.refcount(old[0]) == 1  # ... and still holds its page
    assert cache.pages.refcount(new[0]) == 1


def test_slot_pressure_drops_an_interior_checkpoint_but_keeps_its_page() -> None:
    cache = make()
    pages = checkpoint(cache, [1, 2, 3, 4])
    checkpoint(cache, [1, 2, 3, 4, 5, 6, 7, 8], tuple(pages))
    cache.match([1, 2, 3, 4, 9])  # the interior checkpoint is the more recent
    cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert cache.evict("slot")
    # The LRU checkpoint was the interior one (touched first); its page stays for the leaf.
    assert cache.find([1, 2, 3, 4]).slot is None
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 8
    assert cache.pages.refcount(pages[0]) == 1


def test_pinned_entries_go_last_and_tell_their_session() -> None:
    sessions = SessionPins()
    cache = PrefixCache(PS, SlotAllocator(8), PageAllocator(8), sessions.entry_evicted)
    checkpoint(cache, [1, 2, 3])
    checkpoint(cache, [4, 5, 6])
    sessions.keep("s", [cache.find([1, 2, 3])])  # the older one, pinned
    assert cache.evict("page") and cache.find([4, 5, 6]) is None
    assert "s" in sessions
    assert not cache.evict("page", allow_pinned=False)
    assert cache.evict("page") and "s" not in sessions and sessions.evictions == 1


def test_flush_returns_every_slot_and_page() -> None:
    cache = make()
    base = checkpoint(cache, list(range(12)))
    checkpoint(cache, list(range(8)) + [50, 51, 52, 53, 54], tuple(base[:2]))
    checkpoint(cache, [9, 9])
    assert cache.slots.num_used == 3 and cache.pages.num_used > 0
    assert cache.flush() >= 3
    assert cache.slots.num_used == 0 and cache.pages.num_used == 0
    assert cache.num_checkpoints == 0 and cache.num_pages == 0


def test_insert_refuses_too_few_pages() -> None:
    cache = make()
    with pytest.raises(ValueError, match="cannot hold"):
        cache.insert(list(range(9)), [1, 2], 1)
