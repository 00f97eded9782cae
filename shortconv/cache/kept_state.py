"""Where a session's kept state lives in the cache manager, and taking such state in from outside.

A session keeps the state after its latest turn as a pinned tree entry (`sessions.py`): one
checkpoint slot, the KV pages of every earlier position (the tree path's pages, the last one
partly filled for a mid-page checkpoint) and each sliding group's window pages. `kept_state`
names those ids for an export; `reserve` + `adopt` do the reverse for an import: fresh ids to
write a bundle's tensors into, then a tree entry over them that the session pins, exactly as if
this engine had computed the turn itself. `give_back` frees a reservation an import refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from shortconv.cache.allocators import SCRATCH_PAGE
from shortconv.cache.manager import CacheManager
from shortconv.cache.prefix_cache import CacheEntry
from shortconv.cache.window_pages import window_span


@dataclass(frozen=True)
class KeptState:
    """One checkpoint's ids: its slot and, per KV group, the pages from `first_page[g]` on."""

    token_ids: tuple[int, ...]  # the key stream the checkpoint covers
    slot: int
    pages: tuple[tuple[int, ...], ...]
    first_page: tuple[int, ...]


def kept_state(cm: CacheManager, session_id: str) -> KeptState | None:
    """The deepest checkpoint the session pins, or None when it keeps nothing."""
    ps = cm.page_size
    entries = [e for e in cm.sessions.entries(session_id) if e.slot is not None]
    if not entries:
        return None
    entry = max(entries, key=lambda e: e.position(ps))
    assert entry.slot is not None
    tokens, full = _path(entry)
    q = len(tokens)
    spans = [window_span(q, g.window, ps) for g in cm.windows]
    pages = (tuple(full), *entry.windows)
    return KeptState(tuple(tokens), entry.slot, pages, (0, *(s.start for s in spans)))


def window_starts(cm: CacheManager, num_tokens: int) -> tuple[int, ...]:
    """Per KV group, the first logical page a checkpoint after `num_tokens` keeps."""
    ps = cm.page_size
    return (0, *(window_span(num_tokens, g.window, ps).start for g in cm.windows))


def reserve(cm: CacheManager, token_ids: tuple[int, ...]) -> KeptState | None:
    """A fresh slot and the pages a checkpoint after `token_ids` keeps in every KV group
    (evicting cached entries LRU), or None (and nothing held) when there is no room."""
    need = -(-len(token_ids) // cm.page_size)
    starts = window_starts(cm, len(token_ids))
    slot = cm.alloc_slot()
    if slot is None:
        return None
    got: list[tuple[int, ...]] = []
    for g, start in enumerate(starts):
        pages = cm.kv.alloc(g, need - start)
        if pages is None:
            give_back(cm, KeptState(token_ids, slot, tuple(got), starts))
            return None
        got.append(tuple(pages))
    return KeptState(token_ids, slot, tuple(got), starts)


def adopt(cm: CacheManager, session_id: str, held: KeptState) -> bool:
    """Insert a reserved checkpoint (its tensors already written) into the tree and pin it
    for the session. The tree takes the slot and its own page references; ours go back."""
    tables = [
        [SCRATCH_PAGE] * s + list(p) for s, p in zip(held.first_page, held.pages, strict=True)
    ]
    cm.sessions.drop(session_id)
    entry = cm.tree.insert(held.token_ids, tables[0], held.slot, tables[1:])
    _free_pages(cm, held)
    if entry is None:
        return False
    cm.sessions.keep(session_id, [entry])
    return True


def give_back(cm: CacheManager, held: KeptState) -> None:
    """Free a reservation that was not adopted: its slot and every page."""
    cm.slots.free(held.slot)
    _free_pages(cm, held)


def _free_pages(cm: CacheManager, held: KeptState) -> None:
    for allocator, pages in zip(cm.kv.allocators, held.pages, strict=False):
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
