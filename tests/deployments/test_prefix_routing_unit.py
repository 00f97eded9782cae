"""Prefix-aware routing without a Ray runtime: the prefix key, SessionAffinityRouter's choice on
stub replicas, the typed handle calls (retry, cancel) and the ingress (413, 503, streams)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from ray.exceptions import RayActorError, RayTaskError
from ray.serve._private.common import RequestMetadata
from ray.serve.exceptions import BackPressureError
from ray.serve.request_router import PendingRequest
from test_serve_router import StubReplica, make_router

from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from deployments.frontend.openai.replica import Reply, RequestContext
from deployments.frontend.routing.prefix_key import (
    BLOCK_CHARS,
    MAX_BLOCKS,
    chain_hashes,
    chat_prefix,
    completion_prefix,
)
from deployments.frontend.routing.prefix_record import PrefixRecord
from deployments.serve.handle_replica import HandleReplica
from deployments.serve.ingress import IngressConfig, build_ingress_app

SYSTEM = "s" * 512


def chat_body(user: str, system: str = SYSTEM) -> bytes:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return json.dumps({"model": "m", "messages": msgs}).encode()


def key(user: str, system: str = SYSTEM) -> tuple[int, ...]:
    return chat_prefix(ChatCompletionRequest.model_validate_json(chat_body(user, system)))


def test_prefix_key_shares_exactly_the_common_blocks() -> None:
    a, b = key("hello " * 40), key("other " * 40)
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    assert shared >= 512 // BLOCK_CHARS - 1 and a[shared:] != b[shared:]
    # Chained: equal hash i means equal blocks 0..i, so a change early changes everything.
    c = key("hello " * 40, "t" + SYSTEM[1:])
    assert not set(a) & set(c)
    assert len(chain_hashes("x" * BLOCK_CHARS * (MAX_BLOCKS + 5))) == MAX_BLOCKS
    # A short prompt (one partial block) follows only its own copies.
    short = key("hi", "be brief")
    assert short == key("hi", "be brief")
    assert len(short) == 1 and not set(short) & set(key("ho", "be brief"))
    # Completions: the prompt, text or token ids, keyed the same way.
    text = completion_prefix(CompletionRequest(prompt="p" * 300))
    ids = completion_prefix(CompletionRequest(prompt=[5] * 300))
    assert len(text) == 3 and ids and not set(text) & set(ids)


def pending(hashes: list[int], session_id: str = "") -> PendingRequest:
    meta = RequestMetadata(request_id="r", internal_request_id="r", session_id=session_id)
    ctx = RequestContext(session_id or None, tuple(hashes))
    return PendingRequest(args=[], kwargs={"ctx": ctx}, metadata=meta)


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


class FakeCall:
    """What a DeploymentHandle method gives back: awaitable, or iterable when streaming."""

    def __init__(self, items: list[Any]) -> None:
        self.items, self.cancelled = items, False

    def __await__(self) -> Any:
        async def one() -> Any:
            return self._next()

        return one().__await__()

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        return self._next()

    def _next(self) -> Any:
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """Each `.remote()` takes the next scripted call; records the options and calls."""

    def __init__(self, calls: list[FakeCall]) -> None:
        self.calls, self.made, self.opts = calls, [], {}  # type: ignore[var-annotated]

    def options(self, **opts: Any) -> FakeHandle:
        self.opts.update(opts)
        return self

    def __getattr__(self, method: str) -> Any:
        handle = self

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> FakeCall:
                handle.made.append((method, args, kwargs))
                return handle.calls.pop(0)

        return Method()


def test_handle_calls_retry_a_dead_replica_once_and_cancel_on_close() -> None:
    async def main() -> None:
        ok = Reply("r1", {"ok": 1})
        handle = FakeHandle([FakeCall([RayActorError()]), FakeCall([ok])])
        req, ctx = CompletionRequest(prompt="p"), RequestContext("s1", (1, 2))
        replica = HandleReplica(handle, "s1")  # type: ignore[arg-type]
        assert await replica.completion(req, ctx) == ok
        assert handle.opts == {"session_id": "s1"} and handle.made[-1][2] == {"ctx": ctx}
        dead = [FakeCall([RayActorError()]), FakeCall([RayActorError()])]
        with pytest.raises(RayActorError):  # twice dead: the ingress answers 503
            await HandleReplica(FakeHandle(dead)).models()  # type: ignore[arg-type]
        # A stream: the first chunk after one retry; closing it (a client that left) cancels.
        first = FakeCall([RayActorError()])
        second = FakeCall([Reply("r1", {"i": i}) for i in range(100)])
        stream = HandleReplica(FakeHandle([first, second])).chat_stream(  # type: ignore[arg-type]
            ChatCompletionRequest.model_validate_json(chat_body("u")), ctx
        )
        assert [(await anext(stream)).body for _ in range(2)] == [{"i": 0}, {"i": 1}]
        await stream.aclose()  # type: ignore[attr-defined]
        assert first.cancelled and second.cancelled

    asyncio.run(main())


class FakeReplica:
    """The `Replica` methods, scripted by the request's content."""

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, tuple[int, ...]]] = []
        self.sid: str | None = None

    async def chat(self, request: Any, ctx: RequestContext) -> Reply:
        self.calls.append((ctx.session_id, ctx.prefix_hashes))
        content = request.messages[-1].content
        if content == "busy":
            raise BackPressureError(num_queued_requests=9, max_queued_requests=8)
        if content == "refused":  # an APIError from the replica, as Ray hands it back
            cause = APIError("too many", 429, code="slow_down")
            raise RayTaskError("chat", "tb", cause).as_instanceof_cause()
        return Reply("r1", {"text": "one,two"})

    async def chat_stream(self, request: Any, ctx: RequestContext) -> AsyncIterator[Reply]:
        yield Reply("r2", {"i": 0})
        raise RayActorError()

    async def models(self) -> Reply:
        self.calls.append((self.sid, ()))
        return Reply("r1", {"data": []})


def test_ingress_calls_refuses_and_translates() -> None:
    fake = FakeReplica()

    def connect(sid: str | None) -> Any:
        fake.sid = sid
        return fake

    app = build_ingress_app(connect, IngressConfig(model_name="m", max_request_bytes=2048))

    def body(content: str, **kw: Any) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": content}], **kw}

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post(
                "/v1/chat/completions", content=chat_body("u"), headers={"X_Session_Id": "s1"}
            )
            assert (r.status_code, r.json(), r.headers["x-shortconv-replica"]) == (
                200,
                {"text": "one,two"},
                "r1",
            )
            assert fake.calls[-1][0] == "s1" and len(fake.calls[-1][1]) >= 4
            r = await client.post("/v1/completions", content=b"z" * 4096)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await client.post("/v1/chat/completions", json=body("busy"))
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
            r = await client.post("/v1/chat/completions", json=body("refused"))
            assert r.status_code == 429 and r.json()["error"]["code"] == "slow_down"
            r = await client.post("/v1/chat/completions", json=body("x", stream=True))
            events = [e for e in r.text.split("\n") if e.startswith("data: ")]
            assert r.status_code == 200 and r.headers["x-shortconv-replica"] == "r2"
            assert events[0] == 'data: {"i":0}' and events[-1] == "data: [DONE]"
            assert json.loads(events[1][6:])["error"]["code"] == "replica_unavailable"
            r = await client.get("/v1/models")
            assert r.status_code == 200 and fake.calls[-1] == (None, ())

    asyncio.run(main())


def test_prefix_key_is_per_adapter() -> None:
    """A LoRA adapter's prompt shares no prefix hash with the base's or another adapter's (their
    cached states differ); the same adapter's does."""
    msgs = [{"role": "user", "content": "x" * (3 * BLOCK_CHARS)}]
    keys = {
        m: chat_prefix(ChatCompletionRequest.model_validate({"model": m, "messages": msgs}))
        for m in (None, "a", "b")
    }
    assert not set(keys[None]) & set(keys["a"]) and not set(keys["a"]) & set(keys["b"])
    again = ChatCompletionRequest.model_validate({"model": "a", "messages": msgs})
    assert chat_prefix(again) == keys["a"]
    base = completion_prefix(CompletionRequest.model_validate({"prompt": "y" * 300}))
    lora = completion_prefix(CompletionRequest.model_validate({"model": "a", "prompt": "y" * 300}))
    assert not set(base) & set(lora)
