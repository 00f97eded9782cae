"""Sessions on top of the prefix cache: a session is a hint (pin + TTL), not a store of its own.

With prefix caching on, every finished turn leaves its end-of-prompt and end-of-generation
checkpoints in the `PrefixCache`, and a session's next turn finds them by an ordinary lookup.
What `x-session-id` adds is this index: the session's latest checkpoints are pinned (evicted
only after every unpinned entry), the replica reports the sessions it holds to the router, and
a session idle past `ttl_s` loses its pins (its checkpoints stay, as ordinary LRU entries).
Same interface as `SessionStore` where the engine and the Serve layer use one.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from shortconv.cache.prefix_cache import CacheEntry


class CachedSessions:
    def __init__(self, ttl_s: float = 600.0) -> None:
        self.ttl_s = ttl_s
        self._held: OrderedDict[str, tuple[list[CacheEntry], float]] = OrderedDict()  # LRU first
        self._by_entry: dict[int, set[str]] = {}
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._held

    def lookup(self, session_id: str, num_cached: int) -> None:
        """Count a session turn's admission: a hit when it resumed any cached tokens."""
        if num_cached > 0:
            self.hits += 1
        else:
            self.misses += 1

    def keep(self, session_id: str, entries: list[CacheEntry]) -> None:
        """Pin the session's latest checkpoints (unpinning the previous turn's)."""
        self._unpin(session_id)
        unique = list({id(e): e for e in entries}.values())
        if not unique:
            return
        for e in unique:
            e.pins += 1
            self._by_entry.setdefault(id(e), set()).add(session_id)
        self._held[session_id] = (unique, time.monotonic())

    def entry_evicted(self, entry: CacheEntry) -> None:
        """The cache is dropping a pinned checkpoint under pressure: its sessions lose it."""
        for sid in list(self._by_entry.get(id(entry), ())):
            self._unpin(sid)
            self.evictions += 1

    def evict_lru(self) -> bool:
        if not self._held:
            return False
        self._unpin(next(iter(self._held)))
        self.evictions += 1
        return True

    def evict_idle(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        stale = [sid for sid, (_, seen) in self._held.items() if now - seen > self.ttl_s]
        for sid in stale:
            self._unpin(sid)
        self.evictions += len(stale)
        return len(stale)

    def drop(self, session_id: str) -> None:
        self._unpin(session_id)

    def session_ids(self) -> list[str]:
        return list(self._held)

    def _unpin(self, session_id: str) -> None:
        held = self._held.pop(session_id, None)
        if held is None:
            return
        for e in held[0]:
            e.pins -= 1
            sids = self._by_entry.get(id(e))
            if sids is not None:
                sids.discard(session_id)
                if not sids:
                    del self._by_entry[id(e)]
