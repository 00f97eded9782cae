"""Where a session's kept state lives in the cache manager, and taking such state in from outside.

A session keeps the state after its latest turn as pinned tree entries (`sessions.py`): a chat
turn pins two checkpoints, its prompt's end and its last token. Each has one checkpoint slot,
the KV pages of every earlier position (the tree path's pages, the last one partly filled for a
mid-page checkpoint) and each sliding group's window pages. `kept_state` names those ids for an
export, each shared page once; `reserve` + `adopt` do the reverse for an import: fresh ids to
write a bundle's tensors into, then tree entries over them that the session pins, exactly as if
this engine had computed the turn itself. `give_back` frees a reservation an import refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shortconv.cache.allocators import SCRATCH_PAGE
from shortconv.cache.manager import CacheManager
from shortconv.cache.prefix_cache import CacheEntry
from shortconv.cache.state_bundle import BundleCheckpoint
from shortconv.cache.window_pages import window_span


@dataclass(frozen=True)
class HeldIds:
    """One slot per checkpoint and, per KV group, the distinct pages the checkpoints read."""

    slots: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class KeptState:
    """A session's checkpoints (shallowest first, each over a prefix of `token_ids`); their
    page tables index `ids.pages`."""

    token_ids: tuple[int, ...]
    checkpoints: tuple[BundleCheckpoint, ...]
    ids: HeldIds


def kept_state(cm: CacheManager, session_id: str) -> KeptState | None:
    """Every checkpoint the session pins that prefixes its deepest one (a turn's pins always
    do), or None when it keeps nothing."""
    entries = [e for e in cm.sessions.entries(session_id) if e.slot is not None]
    if not entries:
        return None
    entries.sort(key=lambda e: e.position(cm.page_size))
    deepest = tuple(_path(entries[-1])[0])
    distinct: list[dict[int, int]] = [{} for _ in range(1 + len(cm.windows))]
    checkpoints: list[BundleCheckpoint] = []
    slots: list[int] = []
    for entry in entries:
        tokens, full = _path(entry)
        if tuple(tokens) != deepest[: len(tokens)]:
            continue
        tables = (tuple(full), *entry.windows)
        index = tuple(
            tuple(seen.setdefault(p, len(seen)) for p in table)
            for seen, table in zip(distinct, tables, strict=True)
        )
        checkpoints.append(BundleCheckpoint(len(tokens), window_starts(cm, len(tokens)), index))
        assert entry.slot is not None
        slots.append(entry.slot)
    pages = tuple(tuple(seen) for seen in distinct)
    return KeptState(deepest, tuple(checkpoints), HeldIds(tuple(slots), pages))


def window_starts(cm: CacheManager, num_tokens: int) -> tuple[int, ...]:
    """Per KV group, the first logical page a checkpoint after `num_tokens` keeps."""
    ps = cm.page_size
    return (0, *(window_span(num_tokens, g.window, ps).start for g in cm.windows))


def reserve(cm: CacheManager, num_slots: int, num_pages: Sequence[int]) -> HeldIds | None:
    """Fresh slots and `num_pages[g]` pages of every KV group g (evicting cached entries LRU),
    or None (and nothing held) when there is no room. NOTE: an eviction may run the session
    store's spill, which reads the ranks; whatever that raises, nothing taken here stays."""
    slots: list[int] = []
    got: list[tuple[int, ...]] = []
    complete = False
    try:
        complete = _take(cm, num_slots, num_pages, slots, got)
    finally:
        if not complete:
            give_back(cm, HeldIds(tuple(slots), tuple(got)))
    return HeldIds(tuple(slots), tuple(got)) if complete else None


def _take(
    cm: CacheManager,
    num_slots: int,
    num_pages: Sequence[int],
    slots: list[int],
    got: list[tuple[int, ...]],
) -> bool:
    """Fill the caller's `slots` and `got` (so it can give back what a failure left); False
    when the pools run out."""
    for _ in range(num_slots):
        slot = cm.alloc_slot()
        if slot is None:
            return False
        slots.append(slot)
    for g, n in enumerate(num_pages):
        pages = cm.kv.alloc(g, n)
        if pages is None:
            return False
        got.append(tuple(pages))
    return True


def adopt(
    cm: CacheManager,
    session_id: str,
    token_ids: tuple[int, ...],
    checkpoints: Sequence[BundleCheckpoint],
    ids: HeldIds,
) -> bool:
    """Insert reserved checkpoints (their tensors already written) into the tree and pin them
    for the session. The tree takes the slots and its own page references; ours go back."""
    cm.sessions.drop(session_id)
    entries: list[CacheEntry | None] = []
    for c, slot in zip(checkpoints, ids.slots, strict=True):
        tables = [
            [SCRATCH_PAGE] * start + [distinct[i] for i in index]
            for start, index, distinct in zip(c.first_page, c.pages, ids.pages, strict=True)
        ]
        entries.append(cm.tree.insert(token_ids[: c.num_tokens], tables[0], slot, tables[1:]))
    _free_pages(cm, ids)
    live = [e for e in entries if e is not None]
    if not live:
        return False
    cm.sessions.keep(session_id, live)
    return True


def give_back(cm: CacheManager, ids: HeldIds) -> None:
    """Free a reservation that was not adopted: its slots and every page."""
    for slot in ids.slots:
        cm.slots.free(slot)
    _free_pages(cm, ids)


def _free_pages(cm: CacheManager, ids: HeldIds) -> None:
    for allocator, pages in zip(cm.kv.allocators, ids.pages, strict=False):
        if pages:
            allocator.free(list(pages))


def _path(entry: CacheEntry) -> tuple[list[int], list[int]]:
    """The tokens and group-0 pages from the root down to `entry` (a tail's partly filled page
    last)."""
    chain: list[CacheEntry] = []
    node: CacheEntry | None = entry
    while node is not None and node.parent is not None:
        chain.append(node)
        node = node.parent
    chain.reverse()
    tokens = [t for e in chain for t in e.tokens]
    return tokens, [e.page for e in chain]
