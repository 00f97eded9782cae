"""The replica never parses raw HTTP: LLMServer is no ingress and holds no ASGI app; the ingress
reaches it by typed calls only, and the one error type crosses the handle whole."""

from __future__ import annotations

import asyncio
import inspect
import pickle
from pathlib import Path

from ray.serve._private.http_util import ASGIAppReplicaWrapper
from starlette.applications import Starlette
from test_serve_api import MODEL, FakeEngine

from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.openai.api import ApiConfig, OpenAIReplica
from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.protocol import CompletionRequest
from deployments.frontend.openai.replica import Replica, RequestContext
from deployments.serve.ingress import OpenAIIngress
from deployments.serve.server import LLMServer

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"


def test_llm_server_is_not_an_http_app() -> None:
    server = LLMServer.func_or_class
    assert not issubclass(server, ASGIAppReplicaWrapper)  # what @serve.ingress makes
    assert issubclass(OpenAIIngress.func_or_class, ASGIAppReplicaWrapper)  # the only one
    assert "__call__" not in vars(server) and "__call__" not in vars(OpenAIReplica)
    assert not any("asgi" in name.lower() for name in dir(server))
    assert not (DEPLOYMENTS / "asgi_forward.py").exists()
    # Every method the ingress calls is there, typed as the Replica protocol says.
    for name, proto in inspect.getmembers(Replica, inspect.isfunction):
        if name.startswith("_"):
            continue
        method = getattr(server, name)
        assert inspect.signature(method).parameters.keys() == (
            inspect.signature(proto).parameters.keys()
        ), name
        streaming = name.endswith("_stream")
        assert inspect.isasyncgenfunction(method) == streaming, name
        assert streaming or inspect.iscoroutinefunction(method), name


def test_replica_holds_no_app_and_answers_typed_calls() -> None:
    async def main() -> None:
        eng = AsyncEngine(FakeEngine(), admission_limit=4)
        eng.start()
        try:
            replica = OpenAIReplica(eng, ApiConfig(model_name=MODEL, replica_id="r0"))
            assert not any(isinstance(v, Starlette) for v in vars(replica).values())
            ctx = RequestContext("s1", (7, 8))
            reply = await replica.completion(CompletionRequest(prompt=[5, 6], max_tokens=2), ctx)
            assert reply.replica_id == "r0" and reply.body["choices"][0]["text"] == "ab"
            assert replica.prefixes.report() == [7, 8]  # recorded once served
            await replica.reset_prefix_cache()
            assert replica.prefixes.report() == []
        finally:
            eng.shutdown()

    asyncio.run(main())


def test_api_error_crosses_the_handle_whole() -> None:
    err = APIError(
        "busy", 503, "server_overloaded", "max_tokens", "overloaded", {"retry-after": "1"}
    )
    got = pickle.loads(pickle.dumps(err))
    assert type(got) is APIError and got.body() == err.body()
    assert (got.status, got.headers, str(got)) == (503, {"retry-after": "1"}, "busy")
