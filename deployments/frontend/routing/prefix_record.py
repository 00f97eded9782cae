"""A replica's own prefix claims: the hashes (deployments/frontend/routing/prefix_key.py) of the
requests it served, which it reports to the router (deployments/serve/prefix_owners.py). Kept
apart from the router's side so the replica's frontend names no Ray type."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class PrefixRecord:
    """The prefix hashes of requests this replica served, least recently used dropped first;
    reported to the router (`record_routing_stats`) as a sorted list, so the report changes
    only when a hash comes or goes. NOTE: a claim, not a promise: the engine may have evicted
    that prefix since; routing on a stale claim costs a prefill, never a wrong answer."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()

    def report(self) -> list[int]:
        return sorted(self._lru)

    def __len__(self) -> int:
        return len(self._lru)
