"""Which replicas hold a LoRA adapter, for SessionAffinityRouter (deployments/serve/router.py).

A runtime-loaded adapter lives on the replica that loaded it (Ray Serve LLM's multiplexing
does the same), so its requests should go there. Learnt, as sessions and prefixes are, from
the replicas' reports (`routing_stats["loras"]`: the adapter names each holds) and from this
router's own record of where it sent an adapter's request (a replica without the adapter loads
it on that request, deployments/frontend/openai/loras.py, so it holds it from then on).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ray.serve.request_router import ReplicaID, RunningReplica

from deployments.frontend.openai.replica import RequestContext
from deployments.serve.prefix_owners import claims


class LoraHolders:
    def __init__(self) -> None:
        self._reported: dict[str, set[ReplicaID]] = {}
        self._routed: dict[str, set[ReplicaID]] = {}

    def update_reports(self, replicas: Iterable[RunningReplica]) -> None:
        replicas = list(replicas)
        self._reported = reported = claims(replicas, "loras", str)
        # NOTE: a report is the truth for that replica: drop our records it contradicts (an
        # unloaded adapter), keeping those of replicas that have not reported since.
        for name, ids in self._routed.items():
            ids -= {r.replica_id for r in replicas if r.routing_stats} - reported.get(name, set())

    def record_routed(self, name: str, replica_id: ReplicaID) -> None:
        self._routed.setdefault(name, set()).add(replica_id)

    def forget(self, name: str, replica_id: ReplicaID) -> None:
        """`replica_id` was sent `name`'s unload: not a holder, until a report says it is."""
        self._routed.get(name, set()).discard(replica_id)
        self._reported.get(name, set()).discard(replica_id)

    def holders(self, name: str, live: dict[ReplicaID, Any]) -> set[ReplicaID]:
        """The live replicas holding `name` (empty: nobody; any replica loads it on miss)."""
        ids = self._reported.get(name, set()) | self._routed.get(name, set())
        return {rid for rid in ids if rid in live}


def lora_of(kwargs: dict[str, Any] | None) -> str | None:
    """The adapter a handle call is for (its `ctx` kwarg, set by the ingress), or None."""
    ctx = (kwargs or {}).get("ctx")
    return ctx.lora_name if isinstance(ctx, RequestContext) else None
