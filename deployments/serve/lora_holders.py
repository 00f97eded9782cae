"""Which replicas hold a LoRA adapter, for SessionAffinityRouter (deployments/serve/router.py).

A runtime-loaded adapter lives on the replica that loaded it (Ray Serve LLM's multiplexing
does the same), so its requests should go there. Learnt, as sessions and prefixes are, from
the replicas' reports (`routing_stats["loras"]`: the adapter names each holds) and from this
router's own record of where it sent an adapter's request (a replica without the adapter loads
it on that request, deployments/frontend/openai/loras.py, so it holds it from then on).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from ray.serve.request_router import ReplicaID, RunningReplica

from deployments.frontend.openai.replica import RequestContext
from deployments.serve.prefix_owners import claims

# A replica's report may have been taken before a load we routed to it had finished: a report
# counts against our record only once it is at least this much younger than the record (Serve
# collects routing stats every few seconds; under load the round trip took longer).
STALE_REPORT_S = 30.0


class LoraHolders:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._reported: dict[str, set[ReplicaID]] = {}
        self._routed: dict[str, dict[ReplicaID, float]] = {}  # name -> replica -> when routed

    def update_reports(self, replicas: Iterable[RunningReplica]) -> None:
        replicas = list(replicas)
        self._reported = reported = claims(replicas, "loras", str)
        # NOTE: a report is the truth for that replica: drop our records it contradicts (an
        # unloaded adapter), keeping those of replicas that have not reported since and those
        # too recent for the report to have seen.
        reporting = {r.replica_id for r in replicas if r.routing_stats}
        settled = self._clock() - STALE_REPORT_S
        for name, ids in self._routed.items():
            for rid in (reporting - reported.get(name, set())) & ids.keys():
                if ids[rid] <= settled:
                    del ids[rid]

    def record_routed(self, name: str, replica_id: ReplicaID) -> None:
        self._routed.setdefault(name, {})[replica_id] = self._clock()

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
