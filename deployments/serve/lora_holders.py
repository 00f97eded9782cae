"""Which replicas hold a LoRA adapter, for SessionAffinityRouter (deployments/serve/router.py).

A runtime-loaded adapter lives on the replica that loaded it (Ray Serve LLM's multiplexing
does the same), so its requests should go there. Learnt, as sessions and prefixes are, from
the replicas' reports (`routing_stats["loras"]`: the adapter names each holds) and from this
router's own record of where it sent an adapter's request (a replica without the adapter loads
it on that request, deployments/frontend/openai/loras.py, so it holds it from then on).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from ray.serve.request_router import ReplicaID, RunningReplica

from deployments.frontend.openai.replica import RequestContext
from deployments.serve.prefix_owners import claims


class LoraHolders:
    def __init__(self) -> None:
        self._reported: dict[str, set[ReplicaID]] = {}
        self._routed: dict[str, dict[ReplicaID, float]] = {}  # name -> replica -> when (epoch s)

    def update_reports(self, replicas: Iterable[RunningReplica]) -> None:
        replicas = list(replicas)
        self._reported = reported = claims(replicas, "loras", str)
        # NOTE: a report is the truth for that replica from when its list last changed
        # (`loras_at`): it drops our records of that replica it contradicts (an unloaded
        # adapter) when they are older, and none made since (a load the list predates).
        for r in replicas:
            at = float((r.routing_stats or {}).get("loras_at", float("-inf")))
            for name, ids in self._routed.items():
                when = ids.get(r.replica_id)
                if when is not None and when < at and r.replica_id not in reported.get(name, ()):
                    del ids[r.replica_id]

    def record_routed(self, name: str, replica_id: ReplicaID) -> None:
        self._routed.setdefault(name, {})[replica_id] = time.time()

    def forget(self, name: str, replica_id: ReplicaID) -> None:
        """`replica_id` was sent `name`'s unload: not a holder, until a report says it is."""
        self._routed.get(name, {}).pop(replica_id, None)
        self._reported.get(name, set()).discard(replica_id)

    def holders(self, name: str, live: dict[ReplicaID, Any]) -> set[ReplicaID]:
        """The live replicas holding `name` (empty: nobody; any replica loads it on miss)."""
        ids = self._reported.get(name, set()) | self._routed.get(name, {}).keys()
        return {rid for rid in ids if rid in live}


def lora_of(kwargs: dict[str, Any] | None) -> str | None:
    """The adapter a handle call is for (its `ctx` kwarg, set by the ingress), or None."""
    ctx = (kwargs or {}).get("ctx")
    return ctx.lora_name if isinstance(ctx, RequestContext) else None
