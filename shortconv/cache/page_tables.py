"""A request's KV pages in every KV group (`kv_groups`): growth, a hit's shared pages, release.

Group 0 is the full-attention group (`Request.pages`); each sliding-window group has a list of
its own (`Request.window_pages`), indexed alike, with scratch page 0 for pages freed behind the
window (`window_pages`). Owned by the cache manager, which supplies eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from shortconv.cache.allocators import SCRATCH_PAGE, PageAllocator
from shortconv.cache.prefix_cache import CacheHit
from shortconv.cache.window_pages import WindowGroup, free_behind, release_table, window_span

PageCopy = tuple[str, int, int, int]  # (request id, KV group, src, dst)


class PageHolder(Protocol):
    request_id: str
    pages: list[int]  # KV group 0 (full attention)
    window_pages: list[list[int]]  # one list per sliding-window group, scratch 0 behind it
    num_computed: int  # the next chunk starts here


class PageTables:
    """Every KV group's allocator and the requests' page lists in them."""

    def __init__(
        self,
        full: PageAllocator,
        windows: Sequence[WindowGroup],
        page_size: int,
        evict: Callable[[str], bool],
    ) -> None:
        self.full, self.windows, self.page_size = full, tuple(windows), page_size
        self.allocators = [full, *(g.pages for g in self.windows)]
        self._evict = evict  # evict("page" | "slot"): drop one cached entry; False: none left

    def grow(self, req: PageHolder, num_tokens: int) -> bool:
        """Give req the pages to cover num_tokens in every KV group (all or none), evicting
        cached entries LRU; first, a sliding group's pages wholly before the window of the
        chunk starting at `req.num_computed` go back to its pool."""
        tables = [req.pages, *self._window_tables(req)]
        for group, table in zip(self.windows, tables[1:], strict=True):
            free_behind(table, req.num_computed, group, self.page_size)
        need = -(-num_tokens // self.page_size)
        got: list[list[int]] = []
        for g, table in enumerate(tables):
            pages = self.alloc(g, need - len(table))
            if pages is None:
                for done, allocator in zip(got, self.allocators, strict=False):
                    allocator.free(done)
                return False
            got.append(pages)
        for table, pages in zip(tables, got, strict=True):
            table.extend(pages)
        return True

    def alloc(self, group: int, n: int) -> list[int] | None:
        """n fresh pages of a KV group, evicting cached entries LRU: tree pages for group 0,
        checkpoints (which hold the windows' pages) for a sliding group."""
        if n <= 0:
            return []
        allocator = self.allocators[group]
        need = "page" if group == 0 else "slot"
        got = allocator.alloc(n)
        while got is None and self._evict(need):
            got = allocator.alloc(n)
        return got

    def share_hit(self, req: PageHolder, hit: CacheHit) -> None:
        """A reference on every full cached page of the hit, in every KV group (a sliding
        group's table starts with scratch entries up to the window); a partly filled last page
        is not shared but copied into a fresh one (`partial_copies`, after `grow`)."""
        req.pages = list(hit.full_pages)
        self.full.share(req.pages)
        partial = hit.num_tokens % self.page_size != 0
        tables = self._window_tables(req)
        for group, table, window in zip(self.windows, tables, hit.windows, strict=True):
            shared = list(window[:-1] if partial else window)
            group.pages.share(shared)
            first = window_span(hit.num_tokens, group.window, self.page_size).start
            table[:] = [SCRATCH_PAGE] * first + shared

    def partial_copies(self, req: PageHolder, hit: CacheHit) -> tuple[PageCopy, ...]:
        """The copy of a mid-page hit's partly filled last page, per group, into req's own."""
        assert hit.partial_page is not None
        srcs = [hit.partial_page] + [w[-1] for w in hit.windows]
        dsts = [req.pages[-1]] + [t[-1] for t in req.window_pages]
        pairs = enumerate(zip(srcs, dsts, strict=True))
        return tuple((req.request_id, g, src, dst) for g, (src, dst) in pairs)

    def trim(self, req: PageHolder, num_tokens: int) -> None:
        """Free req's pages past those covering num_tokens, in every group (a rejected
        speculation's); they were grown for this request alone, so it holds the only reference."""
        keep = -(-num_tokens // self.page_size)
        tables = [req.pages, *self._window_tables(req)]
        for allocator, table in zip(self.allocators, tables, strict=True):
            dead = [p for p in table[keep:] if p != SCRATCH_PAGE]
            if dead:
                allocator.free(dead)
            del table[keep:]

    def release(self, req: PageHolder) -> None:
        """Free every page req holds, in every group."""
        release_table(req.pages, self.full)
        for group, table in zip(self.windows, self._window_tables(req), strict=True):
            release_table(table, group.pages)

    def _window_tables(self, req: PageHolder) -> list[list[int]]:
        """req's sliding groups' page lists (made empty for a request that holds none yet)."""
        if len(req.window_pages) != len(self.windows):
            req.window_pages = [[] for _ in self.windows]
        return req.window_pages
