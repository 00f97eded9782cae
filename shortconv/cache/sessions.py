"""Sessions: a session is a pin on its latest checkpoints in the cache manager's tree.

Every finished turn of a session leaves two checkpoints of the same conversation in the
`PrefixCache`: the end of its prompt and the end of its generation (prompt + answer, minus the
last sampled token, which was never fed back). The session pins both (pinned entries are evicted
only after every unpinned one) and its next turn resumes from whichever prefixes the new prompt,
so a chat template that re-renders the previous answer differently still resumes from the
prompt. A session idle past `ttl_s`, evicted or dropped loses its pins; what an unpinned entry
becomes is the manager's policy (`on_unpinned`): with prefix caching an ordinary LRU entry, without
it gone at once (its slot and pages back). The replica reports the sessions it holds to the router.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable

from shortconv.cache.prefix_cache import CacheEntry


class SessionPins:
    def __init__(
        self, ttl_s: float = 600.0, on_unpinned: Callable[[CacheEntry], None] | None = None
    ) -> None:
        self.ttl_s = ttl_s
        self._on_unpinned = on_unpinned
        self._held: OrderedDict[str, tuple[list[CacheEntry], float]] = OrderedDict()  # LRU first
        self._by_entry: dict[CacheEntry, set[str]] = {}
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._held

    def holds(self, session_id: str, entry: CacheEntry) -> bool:
        return session_id in self._by_entry.get(entry, ())

    def entries(self, session_id: str) -> list[CacheEntry]:
        """The checkpoints the session pins (none when it holds nothing)."""
        held = self._held.get(session_id)
        return list(held[0]) if held is not None else []

    def holders(self, entry: CacheEntry) -> list[str]:
        """The sessions pinning `entry`."""
        return sorted(self._by_entry.get(entry, ()))

    def lookup(self, session_id: str, num_cached: int) -> None:
        """Count a session turn's admission: a hit when it resumed any cached tokens."""
        if num_cached > 0:
            self.hits += 1
        else:
            self.misses += 1

    def keep(self, session_id: str, entries: Iterable[CacheEntry | None]) -> None:
        """Pin the session's latest checkpoints in place of its previous turn's (the new ones
        are pinned first: an entry in both is never unpinned on the way)."""
        live = [e for e in dict.fromkeys(entries) if e is not None and e.slot is not None]
        old, _ = self._held.pop(session_id, ([], 0.0))
        for e in live:
            e.pins += 1
            self._by_entry.setdefault(e, set()).add(session_id)
        if live:
            self._held[session_id] = (live, time.monotonic())
        self._unpin(session_id, old, still=set(live))

    def entry_evicted(self, entry: CacheEntry) -> None:
        """The cache dropped a pinned checkpoint under pressure: its sessions lose every pin."""
        for sid in list(self._by_entry.get(entry, ())):
            self.drop(sid)
            self.evictions += 1

    def evict_lru(self) -> bool:
        if not self._held:
            return False
        self.drop(next(iter(self._held)))
        self.evictions += 1
        return True

    def evict_idle(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        stale = [sid for sid, (_, seen) in self._held.items() if now - seen > self.ttl_s]
        for sid in stale:
            self.drop(sid)
        self.evictions += len(stale)
        return len(stale)

    def drop(self, session_id: str) -> None:
        held = self._held.pop(session_id, None)
        if held is not None:
            self._unpin(session_id, held[0])

    def session_ids(self) -> list[str]:
        return list(self._held)

    def _unpin(self, session_id: str, entries: list[CacheEntry], still: Collection = ()) -> None:
        for e in entries:
            e.pins -= 1
            if e not in still:
                sids = self._by_entry[e]
                sids.discard(session_id)
                if not sids:
                    del self._by_entry[e]
            if not e.pins and self._on_unpinned is not None:
                self._on_unpinned(e)
