"""The OpenAI layer and the engine loop against a fake engine (no Ray): HTTP in-process, the
ingress app calling the replica's typed methods directly."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.engine.engine_types import EngineOverloaded
from deployments.frontend.openai.api import ApiConfig, OpenAIReplica
from deployments.serve.ingress import IngressConfig, build_ingress_app
from shortconv.cache.sessions import SessionPins
from shortconv.engine.outputs import RequestOutput
from shortconv.engine.stats import EngineStats, StartupReport
from shortconv.sampling.sampling_params import SamplingParams

MODEL = "fake-model"
OFFSET = 4  # ids 0..3 are specials, like the byte tokenizer
EOS = 2


class FakeTokenizer:
    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [OFFSET + (ord(c) % 200) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - OFFSET) if i >= OFFSET else "" for i in ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool
    ) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


class FakeEngine:
    """Generates 'a', 'b', 'c', ... one token per step; optional failure after k steps."""

    max_model_len = 64
    model_dir = Path("fake-model-dir")  # never read: a text-only engine loads no processor
    image_spec = None
    weight_bytes: dict[str, int] = {}

    def __init__(self, fail_after: int | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.metrics = None
        self.sessions = SessionPins()
        self.running: dict[str, RequestOutput] = {}
        self.params: dict[str, SamplingParams] = {}
        self.added: list[tuple[str, list[int], str | None]] = []
        self.aborted: list[str] = []
        self.fail_after = fail_after

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens, too many")

    def add_request(self, prompt_token_ids, params, request_id, session_id=None) -> str:  # noqa: ANN001
        self.added.append((request_id, list(prompt_token_ids), session_id))
        lp = [] if params.logprobs is not None else None
        top = [] if params.logprobs else None
        out = RequestOutput(request_id, list(prompt_token_ids), logprobs=lp, top_logprobs=top)
        out.num_cached_tokens = 3 if session_id else 0
        self.running[request_id], self.params[request_id] = out, params
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.aborted.append(request_id)
        self.params.pop(request_id, None)
        return self.running.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.002)  # keeps a long request from spinning a core
        outs = []
        for rid, out in list(self.running.items()):
            p = self.params[rid]
            tok = OFFSET + ord("a") + len(out.token_ids) % 26
            out.new_token_ids, out.new_text = [tok], chr(tok - OFFSET)
            out.token_ids.append(tok)
            if out.logprobs is not None:
                out.logprobs.append(-0.5)
            if out.top_logprobs is not None:
                out.top_logprobs.append([(tok, -0.5), (tok + 1, -1.5)][: p.logprobs])
            if self.fail_after is not None and len(out.token_ids) > self.fail_after:
                out.finish_reason, out.error = "error", "worker exploded"
            elif len(out.token_ids) >= p.max_tokens:
                out.finish_reason = "length"
            if out.finished:
                self.running.pop(rid)
            outs.append(out)
        return outs

    def stats(self) -> EngineStats:
        n = len(self.running)
        return EngineStats(("conv",), n, 4, 0, 4, n, 0, 0, 0, 0, 0, 0, 0, 0)

    def graph_stats(self) -> None:
        return None

    def flush_prefix_cache(self) -> int:
        return 0

    def refresh_metrics(self) -> None:
        pass

    def check_health(self) -> None:
        pass

    def startup_reports(self) -> list[StartupReport]:
        return []

    def shutdown(self) -> None:
        pass


def serve_app(fn: Callable[[httpx.AsyncClient, FakeEngine, AsyncEngine], Any], **kw: Any) -> Any:
    """Run `fn(client, fake, async_engine)` against the app on a fresh fake engine."""
    fake = FakeEngine(kw.pop("fail_after", None))
    eng = AsyncEngine(fake, admission_limit=kw.pop("admission_limit", 8))
    eng.start()
    replica = OpenAIReplica(eng, ApiConfig(model_name=MODEL, replica_id="r0"))
    app = build_ingress_app(lambda _sid: replica, IngressConfig(model_name=MODEL, **kw))

    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await fn(client, fake, eng)

    try:
        return asyncio.run(main())
    finally:
        eng.shutdown()


def chat(content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def test_openai_client_chat_stream_and_usage() -> None:
    async def run(client: httpx.AsyncClient, fake: FakeEngine, _: AsyncEngine) -> None:
        oai = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=client)
        assert [m.id for m in (await oai.models.list()).data] == [MODEL]
        r = await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert r.choices[0].message.content == "abc" and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens_details.cached_tokens == 0
        stream = await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": "sess-1"},
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert (
            text == "abcd" and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 4
        )
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 3
        assert fake.added[-1][2] == "sess-1"  # the session header reaches the engine

    serve_app(run)


def test_completions_token_prompt_logprobs_and_sse() -> None:
    async def run(client: httpx.AsyncClient, *_: Any) -> None:
        r = await client.post(
            "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 1}
        )
        body = r.json()
        assert r.status_code == 200 and r.headers["x-shortconv-replica"] == "r0"
        lp = body["choices"][0]["logprobs"]
        assert body["choices"][0]["text"] == "ab" and lp["tokens"] == ["a", "b"]
        assert lp["token_logprobs"] == [-0.5, -0.5] and lp["top_logprobs"][0] == {"a": -0.5}
        r = await client.post(
            "/v1/chat/completions", json=chat(max_tokens=2, logprobs=True, top_logprobs=2)
        )
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == ["a", "b"] and len(content[0]["top_logprobs"]) == 2
        r = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}
        )
        lines = [x for x in r.text.split("\n\n") if x]
        # Deltas that queue up while the client is slow arrive coalesced (one chunk "ab"), so
        # the oracle is the concatenation, not the chunking.
        texts = [json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]]
        assert lines[-1] == "data: [DONE]" and "".join(texts) == "ab" and texts[0].startswith("a")

    serve_app(run)


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        (chat(n=0), "n"),
        (chat(temperature=-1), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(top_logprobs=50, logprobs=True), "top_logprobs"),
        (chat(stop=[f"s{i}" for i in range(17)]), "stop"),
        (chat(frequency_penalty=2.5), "frequency_penalty"),
        (chat(presence_penalty=-3), "presence_penalty"),
        (chat(logit_bias={"5": 101}), "logit_bias"),
        (chat(logit_bias={"five": 1}), "logit_bias"),
        (chat(min_tokens=-1), "min_tokens"),
        (chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
        (chat(modalities=["text", "audio"]), "modalities"),
        (chat(use_beam_search=True), "use_beam_search"),
        (chat(stream=True, stream_options={"include_usage": True, "continuous": True}), "stream"),
        (chat(tools=[{"type": "function"}]), "tools"),
        (chat(bogus=1), "bogus"),
        (chat("x" * 80), "prompt"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "prompt": ["a", ""]}, "prompt.1"),
        ({"model": MODEL, "prompt": "a", "echo": True, "logprobs": 1}, "echo"),
        ({"model": MODEL, "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_input_is_400_openai_style(payload: dict[str, Any], param: str) -> None:
    async def run(client: httpx.AsyncClient, *_: Any) -> None:
        route = "/v1/completions" if "prompt" in payload else "/v1/chat/completions"
        r = await client.post(route, json=payload)
        err = r.json()["error"]
        assert r.status_code == 400, r.text
        assert (
            set(err) == {"message", "type", "param", "code"}
            and err["type"] == "invalid_request_error"
        )
        assert err["param"] is not None and err["param"].startswith(param), err

    serve_app(run)


def test_edge_errors() -> None:
    async def run(client: httpx.AsyncClient, *_: Any) -> None:
        auth = {"authorization": "Bearer k"}
        r = await client.post("/v1/chat/completions", content=b"{not json", headers=auth)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = await client.post("/v1/chat/completions", json=chat(), headers=auth)
        assert r.status_code == 200
        r = await client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await client.post(
            "/v1/chat/completions", json={**chat(), "model": "other"}, headers=auth
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await client.post("/v1/completions", json={"prompt": "y" * 3000}, headers=auth)
        assert r.status_code == 413
        r = await client.get("/v1/nothing-here")
        assert r.status_code == 404 and "error" in r.json()

    serve_app(run, api_key="k", max_request_bytes=2048)


def test_engine_failure_is_an_error_not_a_hang() -> None:
    async def run(client: httpx.AsyncClient, *_: Any) -> None:
        r = await client.post("/v1/chat/completions", json=chat(max_tokens=8))
        assert r.status_code == 500 and r.json()["error"]["message"] == "worker exploded"
        r = await client.post("/v1/chat/completions", json=chat(max_tokens=8, stream=True))
        events = [x for x in r.text.split("\n\n") if x]
        assert json.loads(events[-2][6:])["error"]["code"] == "engine_error"
        assert events[-1] == "data: [DONE]"

    serve_app(run, fail_after=1)


def test_consumer_exit_aborts_and_frees() -> None:
    """A consumer that stops reading (client disconnect) aborts its engine request."""

    async def run(_: httpx.AsyncClient, fake: FakeEngine, eng: AsyncEngine) -> None:
        stream = eng.generate([5, 6], SamplingParams(max_tokens=10_000), "long", None)
        it = aiter(stream)
        await anext(it)
        await anext(it)
        assert fake.running
        await stream.aclose()  # type: ignore[attr-defined]
        for _ in range(200):
            if not fake.running and eng.stats().get("num_active_requests") == 0:
                break
            await asyncio.sleep(0.01)
        assert fake.aborted == ["long"] and not fake.running
        assert eng.stats()["num_active_requests"] == 0

    serve_app(run)


def test_overload_is_503_and_health() -> None:
    async def run(client: httpx.AsyncClient, fake: FakeEngine, eng: AsyncEngine) -> None:
        assert (await client.get("/health")).status_code == 200
        streams = [eng.generate([5], SamplingParams(max_tokens=10_000), f"r{i}") for i in range(2)]
        firsts = [await anext(aiter(s)) for s in streams]
        assert all(d.token_ids for d in firsts)
        r = await client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
        eng._error = "simulated crash"
        assert (await client.get("/health")).status_code == 503

    serve_app(run, admission_limit=2)


def test_admission_is_counted_at_admission_and_always_given_back() -> None:
    """A burst cannot overshoot: a stream counts from `generate`, before it is iterated; and
    it gives its place back when it ends, is closed, or is dropped without being started."""

    async def run(client: httpx.AsyncClient, fake: FakeEngine, eng: AsyncEngine) -> None:
        params = SamplingParams(max_tokens=3)
        held = [eng.generate([5], params, f"r{i}") for i in range(2)]  # none iterated yet
        assert eng.num_admitted == 2
        with pytest.raises(EngineOverloaded):
            eng.generate([5], params, "r2")
        r = await client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        del held
        gc.collect()
        assert eng.num_admitted == 0 and not fake.running  # nothing had been queued
        finished = [d async for d in eng.generate([5], params, "done")]
        assert finished[-1].finish_reason == "length" and eng.num_admitted == 0
        closed = eng.generate([5], SamplingParams(max_tokens=10_000), "closed")
        await anext(aiter(closed))
        await closed.aclose()  # type: ignore[attr-defined]
        assert eng.num_admitted == 0

    serve_app(run, admission_limit=2)
