"""Which replicas are likely to hold a prompt's prefix, from its chain of prefix hashes.

Learnt two ways, as for sessions (deployments/serve/router.py):
  * the replicas' reports (`routing_stats["prefixes"]`: hashes of prompts they served), which
    reach every router and survive router restarts;
  * this router's own record of where it last sent each hash, right at once, so the second
    request of a burst follows the first before any report arrives.
Keyed by replica id, so a replica that joins strands nothing and one that leaves only drops
its claims. Hash i of a chain covers the whole prefix up to block i
(deployments/frontend/routing/prefix_key.py),
so the deepest hash some live replica holds is the longest shared prefix.
A replica's own claims are its `PrefixRecord` (deployments/frontend/routing/prefix_record.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ray.serve.request_router import ReplicaID, RunningReplica

from deployments.frontend.openai.replica import RequestContext

DEFAULT_MAX_TRACKED_PREFIXES = 100_000
_K = TypeVar("_K")


class PrefixOwners:
    def __init__(self, max_tracked: int = DEFAULT_MAX_TRACKED_PREFIXES) -> None:
        self.max_tracked = max_tracked
        self._routed: OrderedDict[int, ReplicaID] = OrderedDict()
        self._reported: dict[int, set[ReplicaID]] = {}

    def update_reports(self, replicas: Iterable[RunningReplica]) -> None:
        self._reported = claims(replicas, "prefixes", int)

    def record_routed(self, hashes: Sequence[int], replica_id: ReplicaID) -> None:
        for h in hashes:
            self._routed[h] = replica_id
            self._routed.move_to_end(h)
        while len(self._routed) > self.max_tracked:
            self._routed.popitem(last=False)

    def holders(
        self, hashes: Sequence[int], live: dict[ReplicaID, Any]
    ) -> tuple[int, set[ReplicaID]]:
        """(matched blocks, the live replicas holding that longest matched prefix); (0, {})
        when no live replica holds even the first block."""
        for depth in range(len(hashes), 0, -1):
            h = hashes[depth - 1]
            found = {rid for rid in self._reported.get(h, ()) if rid in live}
            mine = self._routed.get(h)
            if mine is not None and mine in live:
                found.add(mine)
            if found:
                return depth, found
        return 0, set()


def claims(
    replicas: Iterable[RunningReplica], key: str, cast: Callable[[Any], _K]
) -> dict[_K, set[ReplicaID]]:
    """Each item the replicas report under `routing_stats[key]` -> the replicas reporting it."""
    out: dict[_K, set[ReplicaID]] = {}
    for r in replicas:
        for item in (r.routing_stats or {}).get(key) or ():
            out.setdefault(cast(item), set()).add(r.replica_id)
    return out


def hashes_of(kwargs: dict[str, Any] | None) -> list[int]:
    """The prefix key of a handle call (its `ctx` kwarg, set by the ingress); [] without one."""
    ctx = (kwargs or {}).get("ctx")
    return list(ctx.prefix_hashes) if isinstance(ctx, RequestContext) else []
