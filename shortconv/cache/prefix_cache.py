"""Automatic prefix caching for hybrid state: a radix tree over KV pages with state checkpoints.

Why a tree of pages: a hybrid model resumes only where it has *both* the attention context (KV
pages for every earlier position) and the recurrent state (short-conv state, ZAYA1's CCA conv
and previous-token state) at that exact position. KV pages are shareable by reference; the
recurrent state is not (it is one value per position), so it is checkpointed into spare state
slots at chosen positions. Each tree node is one full KV page of tokens (its key), so the path
from the root spells a token prefix in page-sized steps and the pages along it are that
prefix's KV. A node may hold a checkpoint slot (the state after its last token), and a node's
`tails` hold checkpoints that end inside the next page (e.g. an end of prompt mid-page): a tail
keeps its own reference to that partly filled page, which a resuming request copies (copy on
write) because the page's owner goes on writing past the tail.

A lookup walks the prompt's full pages down the tree and returns the deepest checkpoint that
prefixes the prompt and ends before its last token (a request must feed at least one token to
get fresh logits). Every page and slot the tree holds carries one reference of its own, so
eviction (LRU, leaves and tails first) only drops the tree's references: a running request that
resumed from an entry holds its own page references and its own copy of the state.

Pure Python, owned by the cache manager (`manager.py`); slot and page ids are the allocators'
(the same on every rank).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.window_pages import WindowGroup, release_windows, take_windows


@dataclass(eq=False)
class CacheEntry:
    """A full-page node (len(tokens) == page_size) or a tail (shorter; a checkpoint mid-page)."""

    tokens: tuple[int, ...]
    page: int  # the KV page of these tokens (the tree holds one reference); -1 at the root
    parent: CacheEntry | None
    depth: int  # full pages above and including this node (a tail: those of its parent)
    slot: int | None = None  # checkpoint: the state after this entry's last token
    children: dict[tuple[int, ...], CacheEntry] = field(default_factory=dict)
    tails: dict[tuple[int, ...], CacheEntry] = field(default_factory=dict)
    pins: int = 0  # sessions holding this checkpoint (evicted only after unpinned entries)
    is_tail: bool = False
    # With the checkpoint: each sliding-window group's pages a resume reads (`window_pages`).
    windows: tuple[tuple[int, ...], ...] = ()

    def position(self, page_size: int) -> int:
        """Tokens covered by this entry's checkpoint."""
        base = (self.depth - (0 if self.is_tail else 1)) * page_size
        return base + len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children and not self.tails


@dataclass(frozen=True)
class CacheHit:
    """Where a request resumes: `num_tokens` covered, the checkpoint slot to copy from, the full
    pages to share, and (a mid-page checkpoint) the partly filled page to copy on write; per
    sliding-window group, the pages of the window before `num_tokens` (`window_span`; the last
    one partly filled, and copied on write too, when the checkpoint is mid-page)."""

    num_tokens: int
    slot: int
    full_pages: tuple[int, ...]
    partial_page: int | None
    entry: CacheEntry
    windows: tuple[tuple[int, ...], ...] = ()


@dataclass
class CacheCounters:
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens resumed from the cache
    evictions: int = 0  # entries evicted (whole entries and checkpoint slots alike)


class PrefixCache:
    """Radix tree of KV pages with state checkpoints (see the module docstring)."""

    def __init__(
        self,
        page_size: int,
        slots: SlotAllocator,
        pages: PageAllocator,
        on_evict_pinned: Callable[[CacheEntry], None] | None = None,
        windows: Sequence[WindowGroup] = (),
        before_evict_pinned: Callable[[CacheEntry], None] | None = None,
    ) -> None:
        self.page_size = page_size
        self.slots, self.pages = slots, pages
        self.windows = tuple(windows)
        self.root = CacheEntry((), -1, None, 0)
        self.counters = CacheCounters()
        self.num_checkpoints = 0
        self._held: dict[int, int] = {}  # page -> the tree's references to it
        # Every entry, least recently used first (a touch moves an entry and its ancestors to
        # the end), so eviction finds its victim near the front instead of walking the tree.
        self._order: OrderedDict[int, CacheEntry] = OrderedDict()
        self._on_evict_pinned = on_evict_pinned
        # Told while a pinned victim still holds its slot and pages (a session store spills it).
        self._before_evict_pinned = before_evict_pinned

    # ---- lookup -------------------------------------------------------------------------
    def match(
        self, tokens: Sequence[int], usable: Callable[[CacheEntry], bool] | None = None
    ) -> CacheHit | None:
        """The deepest checkpoint that prefixes `tokens` and covers fewer than all of them
        (only those `usable` accepts, when given). Counts nothing: the cache manager counts a
        lookup once its request is admitted."""
        ps, n = self.page_size, len(tokens)
        node, pos = self.root, 0
        path: list[int] = []
        best: tuple[CacheEntry, tuple[int, ...]] | None = None
        ok = functools.partial(self._resumable, usable=usable)
        while True:
            if node.slot is not None and 0 < pos < n and ok(node):
                best = (node, tuple(path))
            for key, tail in node.tails.items():
                end = pos + len(key)
                if end < n and (best is None or end > best[0].position(ps)) and ok(tail):
                    if tuple(tokens[pos:end]) == key:
                        best = (tail, tuple(path))
            child = node.children.get(tuple(tokens[pos : pos + ps])) if n - pos >= ps else None
            if child is None:
                break
            node, pos = child, pos + ps
            path.append(child.page)
        if best is None:
            return None
        entry, pages = best
        self._touch(entry)
        covered = entry.position(ps)
        full = pages[: covered // ps]
        partial = entry.page if entry.is_tail else None
        assert entry.slot is not None
        return CacheHit(covered, entry.slot, full, partial, entry, entry.windows)

    def _resumable(
        self, entry: CacheEntry, usable: Callable[[CacheEntry], bool] | None = None
    ) -> bool:
        # NOTE: a checkpoint without every window's pages cannot be resumed: never match it.
        return len(entry.windows) == len(self.windows) and (usable is None or usable(entry))

    def find(self, tokens: Sequence[int]) -> CacheEntry | None:
        """The entry whose checkpoint covers exactly `tokens`, if there is one."""
        node = self._walk(tokens, create=None)
        if node is None:
            return None
        rest = len(tokens) % self.page_size
        if rest == 0:
            return node if node is not self.root else None
        return node.tails.get(tuple(tokens[len(tokens) - rest :]))

    # ---- insertion ----------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        slot: int,
        window_tables: Sequence[Sequence[int]] = (),
    ) -> CacheEntry | None:
        """Checkpoint `slot` (the state after `tokens`) whose KV lies in `pages` (and, per
        sliding-window group, in `window_tables`).

        The cache takes ownership of `slot` (freed at once when the same checkpoint is already
        held, or when a window page it needs was freed: None, nothing kept) and takes its own
        reference on every page it keeps.
        """
        ps = self.page_size
        if not tokens:
            raise ValueError("a checkpoint covers at least one token")
        if len(pages) < -(-len(tokens) // ps):
            raise ValueError(f"{len(pages)} pages cannot hold {len(tokens)} tokens")
        windows = take_windows(window_tables, len(tokens), self.windows, ps)
        if windows is None:
            self.slots.free(slot)
            return None
        node = self._walk(tokens, create=pages)
        assert node is not None
        rest = len(tokens) % ps
        if rest:
            key = tuple(tokens[len(tokens) - rest :])
            entry = node.tails.get(key)
            if entry is None:
                page = pages[len(tokens) // ps]
                self._hold(page)
                entry = CacheEntry(key, page, node, node.depth, is_tail=True)
                node.tails[key] = entry
        else:
            entry = node
        if entry.slot is None:
            entry.slot, entry.windows = slot, windows
            self.num_checkpoints += 1
        else:
            self.slots.free(slot)
            release_windows(windows, self.windows)
        self._touch(entry)
        return entry

    def _walk(self, tokens: Sequence[int], create: Sequence[int] | None) -> CacheEntry | None:
        """The node of `tokens`' full pages; with `create` (the pages), missing nodes are added."""
        ps, node = self.page_size, self.root
        for i in range(len(tokens) // ps):
            key = tuple(tokens[i * ps : (i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                if create is None:
                    return None
                self._hold(create[i])
                child = CacheEntry(key, create[i], node, node.depth + 1)
                node.children[key] = child
            node = child
        return node

    # ---- eviction -----------------------------------------------------------------------
    def evict(self, need: str, allow_pinned: bool = True) -> bool:
        """Drop the least recently used entry that frees a `need` ("slot" or "page") from the
        tree; pinned entries only when nothing unpinned qualifies. False: nothing to drop."""
        victim = self._lru(need, pinned=False) or (
            self._lru(need, pinned=True) if allow_pinned else None
        )
        if victim is None:
            return False
        if victim.pins and self._before_evict_pinned is not None:
            self._before_evict_pinned(victim)
        self._drop(victim, whole=need == "page" or victim.is_leaf or victim.is_tail)
        self.counters.evictions += 1
        # NOTE: told after the drop: the pins it loses may discard its other entries.
        if victim.pins and self._on_evict_pinned is not None:
            self._on_evict_pinned(victim)
        return True

    def discard(self, entry: CacheEntry) -> None:
        """Drop `entry`'s checkpoint, and its page unless deeper entries still need it (no-op
        for an entry already evicted)."""
        if entry.slot is not None:
            self._drop(entry, whole=entry.is_leaf or entry.is_tail)

    def flush(self) -> int:
        """Drop every entry (pinned included); returns how many were dropped."""
        dropped = 0
        while self.evict("page") or self.evict("slot"):
            dropped += 1
        return dropped

    def _lru(self, need: str, pinned: bool) -> CacheEntry | None:
        for e in self._order.values():
            if bool(e.pins) != pinned:
                continue
            if need == "slot" and e.slot is None:
                continue
            if need == "page" and not (e.is_tail or e.is_leaf):
                continue
            return e
        return None

    def _drop(self, entry: CacheEntry, whole: bool) -> None:
        if entry.slot is not None:
            self.slots.free(entry.slot)
            release_windows(entry.windows, self.windows)
            entry.slot, entry.windows = None, ()
            self.num_checkpoints -= 1
        if not whole:
            return
        parent = entry.parent
        assert parent is not None and (entry.is_tail or entry.is_leaf)
        if entry.is_tail:
            del parent.tails[entry.tokens]
        else:
            del parent.children[entry.tokens]
        self._order.pop(id(entry), None)
        self._release_page(entry.page)
        # NOTE: a leaf without a checkpoint serves no lookup; drop it so every leaf is useful.
        if parent is not self.root and parent.is_leaf and parent.slot is None:
            self._drop(parent, whole=True)

    @property
    def num_pages(self) -> int:
        """Distinct KV pages the tree holds (a node and a tail may share one)."""
        return len(self._held)

    def _hold(self, page: int) -> None:
        self.pages.share([page])
        self._held[page] = self._held.get(page, 0) + 1

    def _release_page(self, page: int) -> None:
        self.pages.free([page])
        left = self._held[page] - 1
        if left:
            self._held[page] = left
        else:
            del self._held[page]

    def _touch(self, entry: CacheEntry) -> None:
        path: list[CacheEntry] = []
        node: CacheEntry | None = entry
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        for node in reversed(path):  # an ancestor is at least as recent as its descendants
            self._order[id(node)] = node
            self._order.move_to_end(id(node))
