"""LoRA routing without a Ray runtime: SessionAffinityRouter sends an adapter's requests to the
replicas that hold it (reported or routed there), a session's owner still wins, and a replica
without the adapter loads it on a miss from the ingress's record (or answers 404)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest
from test_prefix_routing_unit import choose
from test_serve_router import StubReplica, make_router

from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.loras import ReplicaLoras
from deployments.frontend.routing.lora_paths import LoraPaths


def holding(
    uid: str, loras: list[str], sessions: dict[str, float] | None = None, at: float = 0.0
) -> Any:
    r = StubReplica(uid, sessions)
    r.routing_stats["loras"] = loras
    r.routing_stats["loras_at"] = at  # when the replica's list last changed (epoch s)
    return r


def lora_request(
    name: str | None, session_id: str = "", prefix: tuple[int, ...] = (), method: str = "chat"
) -> Any:
    meta = RequestMetadata(
        request_id="r", internal_request_id="r", session_id=session_id, call_method=method
    )
    ctx = LoraPaths().context(session_id or None, prefix, name)
    return PendingRequest(args=[], kwargs={"ctx": ctx}, metadata=meta)


def test_router_sends_an_adapter_to_its_holders() -> None:
    async def main() -> None:
        a, b, c = holding("a", ["x"]), holding("b", ["x", "y"]), holding("c", [])
        router = make_router([a, b, c])
        assert await choose(router, lora_request("x")) == [["a", "b"], ["c"]]
        assert await choose(router, lora_request("y")) == [["b"], ["a", "c"]]
        # Nobody holds it: everyone (the chosen replica loads it, or answers 404).
        assert await choose(router, lora_request("z")) == [["a", "b", "c"]]
        assert await choose(router, lora_request(None)) == [["a", "b", "c"]]
        # A session's owner wins over the adapter's holders.
        s = holding("s", [], {"sess": 1.0})
        router.update_replicas([a, b, c, s])  # type: ignore[list-item]
        assert await choose(router, lora_request("y", "sess")) == [["s"], ["a", "b", "c"]]

    asyncio.run(main())


def test_router_records_where_it_sent_an_adapter_until_a_report_says_otherwise() -> None:
    async def main() -> None:
        a, b = holding("a", []), holding("b", [])
        router = make_router([a, b])
        req = lora_request("z")
        router.on_request_routed(req, b.replica_id, None)  # b loads z on this request
        assert await choose(router, lora_request("z")) == [["b"], ["a"]]
        # A report whose list predates the load leaves the record standing.
        router.update_replicas([a, holding("b", [], at=time.time() - 60)])  # type: ignore[list-item]
        assert await choose(router, lora_request("z")) == [["b"], ["a"]]
        router.update_replicas([a, holding("b", [], at=time.time() + 1)])  # type: ignore[list-item]
        assert await choose(router, lora_request("z")) == [["a", "b"]]  # b unloaded it since

    asyncio.run(main())


def test_an_unload_sent_to_a_holder_leads_the_next_one_to_another() -> None:
    """The ingress unloads until a 404: each call must reach a holder not yet unloaded."""

    async def main() -> None:
        a, b, c = holding("a", ["x"]), holding("b", ["x"]), holding("c", [])
        router = make_router([a, b, c])
        router.on_request_routed(lora_request("x", method="unload_lora"), a.replica_id, None)
        assert await choose(router, lora_request("x", method="unload_lora")) == [["b"], ["a", "c"]]
        router.on_request_routed(lora_request("x", method="unload_lora"), b.replica_id, None)
        assert await choose(router, lora_request("x")) == [["a", "b", "c"]]  # no holder left

    asyncio.run(main())


class _FakeEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    async def update_lora(self, op: str, name: str, path: str = "") -> str | None:
        self.calls.append((op, name, path))
        return "rank 16 is above max_lora_rank 8" if "bad" in path else None


def test_replica_loads_on_miss_once_and_404s_without_a_path() -> None:
    async def main() -> None:
        loras, engine = ReplicaLoras("base", {"y": "/ad/y"}), _FakeEngine()
        e: Any = engine
        with pytest.raises(APIError) as err:
            await loras.ensure(e, "z", None)
            loras.adapter_for("z")
        assert err.value.status == 404 and err.value.code == "model_not_found"
        await asyncio.gather(loras.ensure(e, "z", "/ad/z"), loras.ensure(e, "z", "/ad/z"))
        assert engine.calls == [("load", "z", "/ad/z")] and loras.adapter_for("z") == "z"
        with pytest.raises(APIError) as err:
            await loras.ensure(e, "w", "/ad/bad")
        assert err.value.status == 400 and "max_lora_rank" in err.value.message
        assert loras.adapter_for("base") is None and loras.adapter_for(None) is None

    asyncio.run(main())
