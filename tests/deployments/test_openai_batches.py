"""Completions batches and continuous usage on the fake engine (no Ray): a batch is one engine
request per prompt, merged; leaving early aborts all of them; an admission refused part-way
queues none; usage in every chunk."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from test_serve_api import MODEL, FakeEngine, serve_app

from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.openai.protocol import CompletionRequest
from deployments.frontend.openai.replica import RequestContext


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    events = [e[6:] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]", r.text
    return [json.loads(e) for e in events[:-1]]


def test_a_batch_gives_one_choice_per_prompt_and_sums_usage() -> None:
    async def run(client: httpx.AsyncClient, fake: FakeEngine, _: AsyncEngine) -> None:
        body = {"model": MODEL, "prompt": ["ab", "c"], "max_tokens": 3, "echo": True}
        r = await client.post("/v1/completions", json=body)
        out = r.json()
        assert r.status_code == 200, out
        assert [c["index"] for c in out["choices"]] == [0, 1]
        assert [c["text"] for c in out["choices"]] == ["ababc", "cabc"]
        assert out["usage"]["prompt_tokens"] == 2 + 1
        assert out["usage"]["completion_tokens"] == 6
        ids = await client.post("/v1/completions", json={**body, "prompt": [[9, 9, 9], [10]]})
        assert [c["text"] for c in ids.json()["choices"]] == ["\x05\x05\x05abc", "\x06abc"]
        assert len(fake.added) == 4 and len({rid for rid, *_ in fake.added}) == 4

    serve_app(run)


def test_leaving_a_streamed_batch_aborts_every_prompt() -> None:
    async def run(_: httpx.AsyncClient, fake: FakeEngine, eng: AsyncEngine) -> None:
        from deployments.frontend.openai.api import ApiConfig, OpenAIReplica

        replica = OpenAIReplica(eng, ApiConfig(model_name=MODEL))
        req = CompletionRequest.model_validate(
            {"prompt": ["a", "b", "c", "d"], "max_tokens": 50, "stream": True}
        )
        stream = replica.completion_stream(req, RequestContext())
        for _ in range(6):
            await anext(stream)
        assert len(fake.running) == 4
        await stream.aclose()  # type: ignore[attr-defined]
        for _ in range(200):
            if not fake.running and eng.stats().get("num_active_requests") == 0:
                break
            await asyncio.sleep(0.01)
        assert sorted(fake.aborted) == sorted(rid for rid, *_ in fake.added) and not fake.running
        assert eng.stats()["num_active_requests"] == 0

    serve_app(run)


def test_a_batch_over_the_admission_limit_queues_nothing() -> None:
    async def run(client: httpx.AsyncClient, fake: FakeEngine, eng: AsyncEngine) -> None:
        body = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        assert not fake.added and eng.stats()["num_active_requests"] == 0
        ok = await client.post("/v1/completions", json={**body, "prompt": ["a", "b"]})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2

    serve_app(run, admission_limit=2)


def test_continuous_usage_is_in_every_chunk_and_only_with_include_usage() -> None:
    async def run(client: httpx.AsyncClient, *_: Any) -> None:
        opts = {"include_usage": True, "continuous_usage_stats": True}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = await client.post(
            "/v1/chat/completions", json={**body, "stream": True, "stream_options": opts}
        )
        chunks = _events(r)
        done = [c["usage"]["completion_tokens"] for c in chunks]
        # NOTE: counts, not one chunk per token: a stream that falls behind the engine core
        # takes its backlog as one chunk. The role chunk counts 0, the usage-only chunk the total.
        assert done[0] == 0 and done[-2:] == [3, 3] and done == sorted(done), done
        assert chunks[-1]["choices"] == []
        assert all(
            c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] > 0 for c in chunks
        )
        only = {"include_usage": False, "continuous_usage_stats": True}
        r = await client.post(
            "/v1/chat/completions", json={**body, "stream": True, "stream_options": only}
        )
        assert all("usage" not in c for c in _events(r))

    serve_app(run)
