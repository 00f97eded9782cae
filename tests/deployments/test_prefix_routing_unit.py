"""Prefix-aware routing without a Ray runtime: the prefix key, SessionAffinityRouter's choice on
stub replicas, LLMServer's in-process ASGI forwarding and the ingress relay (413, 503, streams)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray.exceptions import RayActorError
from ray.serve._private.common import RequestMetadata
from ray.serve.exceptions import BackPressureError
from ray.serve.request_router import PendingRequest
from test_serve_router import StubReplica, make_router

from deployments.asgi_forward import ForwardedRequest, PrefixRecord, run_asgi
from deployments.ingress import IngressConfig, build_ingress_app
from deployments.prefix_key import BLOCK_CHARS, MAX_BLOCKS, chain_hashes, prefix_hashes

SYSTEM = "s" * 512


def chat_body(user: str, system: str = SYSTEM) -> bytes:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return json.dumps({"model": "m", "messages": msgs}).encode()


def test_prefix_key_shares_exactly_the_common_blocks() -> None:
    a = prefix_hashes("POST", "/v1/chat/completions", chat_body("hello " * 40))
    b = prefix_hashes("POST", "/v1/chat/completions", chat_body("other " * 40))
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    assert shared >= 512 // BLOCK_CHARS - 1 and a[shared:] != b[shared:]
    # Chained: equal hash i means equal blocks 0..i, so a change early changes everything.
    c = prefix_hashes("POST", "/v1/chat/completions", chat_body("hello " * 40, "t" + SYSTEM[1:]))
    assert not set(a) & set(c)
    assert len(chain_hashes("x" * BLOCK_CHARS * (MAX_BLOCKS + 5))) == MAX_BLOCKS
    # A short prompt (one partial block) follows only its own copies.
    short = prefix_hashes("POST", "/v1/chat/completions", chat_body("hi", "be brief"))
    assert short == prefix_hashes("POST", "/v1/chat/completions", chat_body("hi", "be brief"))
    assert len(short) == 1 and not set(short) & set(
        prefix_hashes("POST", "/v1/chat/completions", chat_body("ho", "be brief"))
    )
    assert prefix_hashes("POST", "/v1/completions", json.dumps({"prompt": "p" * 300}).encode())
    for method, path, body in [
        ("GET", "/v1/models", b""),
        ("POST", "/v1/completions", b'{"prompt": '),
        ("POST", "/v1/completions", b"[" * 4000 + b"]" * 4000),
        ("POST", "/v1/internal/reset_prefix_cache", b""),
    ]:
        assert prefix_hashes(method, path, body) == []


def pending(hashes: list[int], session_id: str = "") -> PendingRequest:
    meta = RequestMetadata(request_id="r", internal_request_id="r", session_id=session_id)
    return PendingRequest(args=[], kwargs={"prefix_hashes": hashes}, metadata=meta)


async def choose(router: Any, req: PendingRequest) -> list[list[str]]:
    got = await router.choose_replicas(router._replicas_list, req)
    return [sorted(r.replica_id.unique_id for r in rank) for rank in got]


def with_prefixes(uid: str, prefixes: list[int], sessions: dict[str, float] | None = None) -> Any:
    r = StubReplica(uid, sessions)
    r.routing_stats["prefixes"] = prefixes
    return r


def test_router_prefers_the_longest_reported_prefix() -> None:
    async def main() -> None:
        chain = [11, 12, 13, 14]
        a, b, c = with_prefixes("a", [11, 12]), with_prefixes("b", [11, 12, 13]), StubReplica("c")
        router = make_router([a, b, c])
        assert await choose(router, pending(chain)) == [["b"], ["a", "c"]]
        # Nothing matches: one rank of everyone (least loaded wins), as without a key.
        assert await choose(router, pending([99, 100])) == [["a", "b", "c"]]
        assert await choose(router, pending([])) == [["a", "b", "c"]]
        # A session owner beats any prefix holder; a session nobody holds uses the prefix.
        s = with_prefixes("s", [], {"sess": 1.0})
        router.update_replicas([a, b, c, s])  # type: ignore[list-item]
        assert await choose(router, pending(chain, "sess")) == [["s"], ["a", "b", "c"]]
        assert (await choose(router, pending(chain, "new")))[0] == ["b"]

    asyncio.run(main())


def test_router_records_where_it_sent_a_prefix_and_drops_gone_holders() -> None:
    async def main() -> None:
        a, b = StubReplica("a"), StubReplica("b")
        router = make_router([a, b])
        req = pending([1, 2, 3])
        assert await choose(router, req) == [["a", "b"]]
        router.on_request_routed(req, b.replica_id, None)
        # The second request of a burst follows the first before any replica has reported.
        assert await choose(router, pending([1, 2, 7])) == [["b"], ["a"]]
        # Reports and the router's record together: both holders share the first rank.
        router.update_replicas([with_prefixes("a", [1, 2, 3]), b])  # type: ignore[list-item]
        assert await choose(router, pending([1, 2, 3])) == [["a", "b"]]
        # Scale-up: a new replica changes nothing; the holder gone: fallback to least-loaded.
        c = StubReplica("c")
        router.update_replicas([a, b, c])  # type: ignore[list-item]
        assert await choose(router, pending([1, 2, 3])) == [["b"], ["a", "c"]]
        router.update_replicas([a, c])  # type: ignore[list-item]
        assert await choose(router, pending([1, 2, 3])) == [["a", "c"]]

    asyncio.run(main())


def test_router_spills_off_a_saturated_holder() -> None:
    async def main() -> None:
        a, b = with_prefixes("a", [5]), StubReplica("b")
        router = make_router([a, b], spill_queue_len=4)
        assert await choose(router, pending([5])) == [["a"], ["b"]]
        router.replica_queue_len_cache.update(a.replica_id, 6)
        router.replica_queue_len_cache.update(b.replica_id, 0)
        assert await choose(router, pending([5])) == [["b"], ["a"]]

    asyncio.run(main())


def test_prefix_record_is_a_bounded_lru() -> None:
    rec = PrefixRecord(capacity=3)
    rec.add([1, 2])
    rec.add([3, 1])
    rec.add([4])
    assert rec.report() == [1, 3, 4] and len(rec) == 3
    rec.clear()
    assert rec.report() == []


def streaming_app(log: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, str]:
        return {"got": (await request.body()).decode(), "q": request.url.query}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def gen() -> AsyncIterator[bytes]:
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0.01)
            finally:
                log.append("closed")

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def test_run_asgi_streams_and_aborts_on_cancel() -> None:
    async def main() -> None:
        log: list[str] = []
        app = streaming_app(log)
        req = ForwardedRequest(
            "POST", "/echo", b"a=1", [(b"content-type", b"application/json")], b"hi"
        )
        got = [m async for m in run_asgi(app, req)]
        assert got[0]["type"] == "http.response.start" and got[0]["status"] == 200
        assert json.loads(b"".join(m.get("body", b"") for m in got[1:])) == {
            "got": "hi",
            "q": "a=1",
        }
        gen = run_asgi(app, ForwardedRequest("GET", "/stream"))
        assert (await gen.__anext__())["status"] == 200
        assert (await gen.__anext__())["body"] == b"data: 0\n\n"  # incremental, not buffered
        await gen.aclose()  # what a cancelled handle call does to the replica's generator
        assert log == ["closed"]

    asyncio.run(main())


def test_ingress_relays_refuses_and_translates() -> None:
    calls: list[tuple[str | None, list[int]]] = []

    async def replica(req: ForwardedRequest, sid: str | None, hashes: list[int]) -> Any:
        calls.append((sid, hashes))
        if req.path == "/busy":
            raise BackPressureError(num_queued_requests=9, max_queued_requests=8)
        if req.path == "/broken":
            sse = [(b"content-type", b"text/event-stream")]
            yield {"type": "http.response.start", "status": 200, "headers": sse}
            yield {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
            raise RayActorError()
        yield {
            "type": "http.response.start",
            "status": 201,
            "headers": [(b"x-shortconv-replica", b"r1")],
        }
        for part in (b"one,", b"two"):
            yield {"type": "http.response.body", "body": part, "more_body": True}
        yield {"type": "http.response.body", "body": b"", "more_body": False}

    app = build_ingress_app(replica, IngressConfig(max_request_bytes=2048))

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post(
                "/v1/chat/completions", content=chat_body("u"), headers={"X_Session_Id": "s1"}
            )
            assert (r.status_code, r.text, r.headers["x-shortconv-replica"]) == (
                201,
                "one,two",
                "r1",
            )
            assert calls[-1][0] == "s1" and len(calls[-1][1]) >= 4
            r = await client.post("/v1/completions", content=b"z" * 4096)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await client.post("/busy", content=b"{}")
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
            r = await client.post("/broken", content=b"{}")
            events = [e for e in r.text.split("\n") if e.startswith("data: ")]
            assert r.status_code == 200 and events[0] == "data: {}" and events[-1] == "data: [DONE]"
            assert json.loads(events[1][6:])["error"]["code"] == "replica_unavailable"
            r = await client.get("/v1/models")
            assert r.status_code == 201 and calls[-1] == (None, [])

    asyncio.run(main())
