"""SessionAffinityRouter: send a session's turns to the replica that holds its state, and a
request without one to the replica most likely to hold its prompt's prefix.

Who owns a session is learnt two ways, and the most recent word wins:
  * this router's own record of where it last sent the session (`on_request_routed`), which is
    right at once, before any replica has reported;
  * the replicas' own reports (`LLMServer.record_routing_stats` -> `replica.routing_stats`,
    session id -> last activity), which survive router restarts, reach every proxy, and
    follow a session that another proxy moved.
Ownership is keyed by replica id, never by a hash of the replica set, so scaling up or down
strands no live session. A session whose owner is gone goes to the least-loaded replica (full
prefill there: slower, never wrong). The owner is ranked first and the other replicas second,
so when the owner is full (Serve's max_ongoing_requests rejection) or above `spill_queue_len`,
the request spills to the least-loaded other replica — queue lengths come from Ray's probing
and cache (`_select_from_candidate_replicas`), not from this class.

Requests without a known session owner that carry a prefix key (`prefix_hashes`, set by the
ingress; deployments/frontend/routing/prefix_key.py) go the same way to the replicas holding the
longest prefix
of it (deployments/serve/prefix_owners.py: replicas' `routing_stats["prefixes"]` plus this router's
own record): holders first, the rest second, the same spill rules. Anything else goes to the
least-loaded replica, preferring this node's (LocalityMixin).

A request for a LoRA adapter (`ctx.lora_name`) without a known session owner goes to the
replicas that hold the adapter (deployments/serve/lora_holders.py), the prefix holders among
them first; when no live replica holds it, to anyone (that replica loads it on the request).
A session's owner still wins: its state was made under the session's adapter.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from deployments.serve.lora_holders import LoraHolders, lora_of
from deployments.serve.prefix_owners import DEFAULT_MAX_TRACKED_PREFIXES, PrefixOwners, hashes_of

DEFAULT_MAX_TRACKED_SESSIONS = 100_000


class SessionAffinityRouter(LocalityMixin, RequestRouter):
    """Session-sticky routing on `RequestMetadata.session_id` (Serve's `x-session-id` header).

    Kwargs (`request_router_config.request_router_kwargs`):
      * spill_queue_len (int | None): spill a session off its owner once the owner has this
        many ongoing requests and another replica has fewer; None (default) spills only when
        the owner rejects (max_ongoing_requests).
      * max_tracked_sessions (int): bound on this router's own session -> replica records.
      * max_tracked_prefixes (int): bound on its own prefix hash -> replica records.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._routed: OrderedDict[str, tuple[ReplicaID, float]] = OrderedDict()
        self._reported: dict[str, list[tuple[float, ReplicaID]]] = {}
        self._spill_queue_len: int | None = None
        self._max_tracked = DEFAULT_MAX_TRACKED_SESSIONS
        self._prefixes = PrefixOwners()
        self._loras = LoraHolders()

    def initialize_state(
        self,
        spill_queue_len: int | None = None,
        max_tracked_sessions: int = DEFAULT_MAX_TRACKED_SESSIONS,
        max_tracked_prefixes: int = DEFAULT_MAX_TRACKED_PREFIXES,
    ) -> None:
        if spill_queue_len is not None and (
            not isinstance(spill_queue_len, int) or spill_queue_len < 1
        ):
            raise ValueError(
                f"spill_queue_len must be None or an int >= 1, got {spill_queue_len!r}"
            )
        if not isinstance(max_tracked_sessions, int) or max_tracked_sessions < 1:
            raise ValueError(
                f"max_tracked_sessions must be an int >= 1, got {max_tracked_sessions!r}"
            )
        if not isinstance(max_tracked_prefixes, int) or max_tracked_prefixes < 1:
            raise ValueError(
                f"max_tracked_prefixes must be an int >= 1, got {max_tracked_prefixes!r}"
            )
        self._spill_queue_len = spill_queue_len
        self._max_tracked = max_tracked_sessions
        self._prefixes.max_tracked = max_tracked_prefixes

    # ---- ownership --------------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Called on every controller broadcast: replica set changes and routing-stats changes."""
        super().update_replicas(replicas)
        reported: dict[str, list[tuple[float, ReplicaID]]] = {}
        for r in replicas:
            sessions = (r.routing_stats or {}).get("sessions") or {}
            for sid, seen in sessions.items():
                reported.setdefault(sid, []).append((float(seen), r.replica_id))
        self._reported = reported
        self._prefixes.update_reports(replicas)
        self._loras.update_reports(replicas)

    def owner_of(self, session_id: str) -> RunningReplica | None:
        """The live replica with the most recent claim on the session, if any."""
        best: tuple[float, ReplicaID] | None = None
        mine = self._routed.get(session_id)
        if mine is not None and mine[0] in self._replicas:
            best = (mine[1], mine[0])
        for seen, rid in self._reported.get(session_id, ()):
            if rid in self._replicas and (best is None or seen > best[0]):
                best = (seen, rid)
        return self._replicas[best[1]] if best is not None else None

    def prefix_holders(self, hashes: list[int]) -> list[RunningReplica]:
        """The live replicas holding the longest prefix of this chain that any holds."""
        _, ids = self._prefixes.holders(hashes, self._replicas)
        return [self._replicas[i] for i in ids]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        hashes = hashes_of(pending_request.kwargs)
        if hashes:
            self._prefixes.record_routed(hashes, replica_id)
        lora = lora_of(pending_request.kwargs)
        if lora is not None and pending_request.metadata.call_method == "unload_lora":
            self._loras.forget(lora, replica_id)  # so a next unload finds another holder
        elif lora is not None:
            self._loras.record_routed(lora, replica_id)
        sid = pending_request.metadata.session_id
        if not sid:
            return
        self._routed[sid] = (replica_id, time.time())
        self._routed.move_to_end(sid)
        while len(self._routed) > self._max_tracked:
            self._routed.popitem(last=False)

    # ---- choice -----------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        preferred = self._preferred(pending_request)
        if not preferred:
            ids = self.apply_locality_routing(pending_request)
            # Shuffled: Ray picks the lowest queue length and the first of equals, so equal
            # loads would otherwise always land on the same replica.
            live = [self._replicas[i] for i in ids if i in self._replicas]
            random.shuffle(live)
            return [live]
        assert pending_request is not None
        pending_request.routing_context.should_backoff = True
        random.shuffle(preferred)  # several holders of a prefix: spread equal loads
        chosen = {r.replica_id for r in preferred}
        others = [r for r in candidate_replicas if r.replica_id not in chosen]
        if not others:
            return [preferred]
        if all(self._owner_saturated(r, others) for r in preferred):
            return [others, preferred]
        return [preferred, others]

    def _preferred(self, pending_request: PendingRequest | None) -> list[RunningReplica]:
        """The session's owner, else the holders of the request's adapter (those of its
        prefix among them first), else the holders of its prefix, else nobody."""
        if pending_request is None:
            return []
        sid = pending_request.metadata.session_id
        owner = self.owner_of(sid) if sid else None
        if owner is not None:
            return [owner]
        hashes = hashes_of(pending_request.kwargs)
        prefix = self.prefix_holders(hashes) if hashes else []
        lora = lora_of(pending_request.kwargs)
        if lora is None:
            return prefix
        holders = self._loras.holders(lora, self._replicas)
        both = [r for r in prefix if r.replica_id in holders]
        return both or [self._replicas[i] for i in holders]

    def _owner_saturated(self, owner: RunningReplica, others: list[RunningReplica]) -> bool:
        if self._spill_queue_len is None:
            return False
        cache = self.replica_queue_len_cache
        q = cache.get(owner.replica_id)
        if q is None or q < self._spill_queue_len:
            return False
        return any((cache.get(r.replica_id) or 0) < q for r in others)

    # ---- introspection (tests, debugging) --------------------------------------------------
    def session_table(self) -> dict[str, str]:
        """session id -> owning replica's full id, as this router currently sees it."""
        sids = set(self._routed) | set(self._reported)
        owners = {sid: self.owner_of(sid) for sid in sids}
        return {sid: r.replica_id.to_full_id_str() for sid, r in owners.items() if r is not None}
