"""Sliding-window KV groups on the host: which pages a window still reads, and freeing the rest.

A sliding group's page list is indexed like the full group's (logical page j covers positions
[j*ps, (j+1)*ps)); a page wholly before the window of the request's next chunk goes back to
the group's allocator and its entry becomes scratch page 0. A chunk starting at `start` reads
positions from `start - w + 1`, so a page is freed only once it ends at or before that.

A checkpoint at position q (the state after q tokens) is resumed by a chunk starting at q, so
it keeps the pages covering [q - w + 1, q) (`window_span`): a prefix-cache entry or session
checkpoint holds references on exactly those, and is usable only while it holds them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shortconv.cache.allocators import SCRATCH_PAGE, PageAllocator
from shortconv.cache.kv_groups import first_live_page, kv_groups
from shortconv.configs.config import ModelConfig


@dataclass(frozen=True)
class WindowGroup:
    """One sliding-window KV group's host side: its window and its page allocator."""

    window: int
    pages: PageAllocator


def window_span(q: int, window: int, page_size: int) -> range:
    """Logical pages a chunk resuming at position q reads from before q."""
    return range(first_live_page(q, window, page_size), -(-q // page_size))


def free_behind(table: list[int], start: int, group: WindowGroup, page_size: int) -> int:
    """Return the pages of `table` wholly before the window of a chunk starting at `start` to
    the group's pool (their entries become scratch page 0); returns how many were freed."""
    lo = min(first_live_page(start, group.window, page_size), len(table))
    dead = [p for p in table[:lo] if p != SCRATCH_PAGE]
    if dead:
        group.pages.free(dead)
        table[:lo] = [SCRATCH_PAGE] * lo
    return len(dead)


def take_windows(
    tables: Sequence[Sequence[int]], q: int, groups: Sequence[WindowGroup], page_size: int
) -> tuple[tuple[int, ...], ...] | None:
    """A reference on each group's pages a resume at q reads, or None (and no reference) when
    any of them was freed already: such a checkpoint can never be resumed."""
    if len(tables) != len(groups):
        return None
    spans = [window_span(q, g.window, page_size) for g in groups]
    taken = []
    for table, span in zip(tables, spans, strict=True):
        pages = tuple(table[span.start : span.stop])
        if len(pages) != len(span) or SCRATCH_PAGE in pages:
            return None
        taken.append(pages)
    for g, pages in zip(groups, taken, strict=True):
        g.pages.share(list(pages))
    return tuple(taken)


def release_windows(windows: Sequence[Sequence[int]], groups: Sequence[WindowGroup]) -> None:
    for g, pages in zip(groups, windows, strict=True):
        g.pages.free(list(pages))


def release_table(table: list[int], pages: PageAllocator) -> None:
    """Free every live page of a request's table (scratch entries hold nothing)."""
    live = [p for p in table if p != SCRATCH_PAGE]
    if live:
        pages.free(live)
    table.clear()


def window_groups(cfg: ModelConfig, num_pages: Sequence[int]) -> tuple[WindowGroup, ...]:
    """The model's sliding-window groups (`kv_groups` 1..), each with its pool of pages."""
    groups = kv_groups(cfg)[1:]
    if len(groups) != len(num_pages):
        raise ValueError(f"{len(groups)} sliding-window KV groups, got {len(num_pages)} sizes")
    return tuple(
        WindowGroup(g.window, PageAllocator(n)) for g, n in zip(groups, num_pages, strict=True)
    )
