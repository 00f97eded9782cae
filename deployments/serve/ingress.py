"""OpenAIIngress: the one HTTP app. Each request is read and checked here once, then served by a
typed call on LLMServer through its handle (deployments/frontend/openai/replica.py).

Why a hop at all: a Serve request router never sees an HTTP body (the proxy hands a replica
only the ASGI scope, and the body is pulled later), so routing on the prompt needs someone to
read it first (Ray Serve LLM's ingress does the same). Here: the API key (401; before the body,
so strangers cannot make us buffer), the body under `max_request_bytes` (413), JSON and the
request schema (400 naming the field), the model name (404) and the session header; then the
prompt's prefix key (deployments/frontend/routing/prefix_key.py) goes with the call, where
SessionAffinityRouter
sees it. Streams are framed as server-sent events here, chunk by chunk as the replica makes
them; a client that disconnects cancels the call, so the replica aborts and frees its slot.
/health and /openapi.json are open (probes and the request schemas carry no data).
The Responses API (`/v1/responses`) is served here as chat calls under the conversation's
session (deployments/frontend/responses/api.py, responses_routes.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.frontend.openai.body import from_validation_error, parse_json_object
from deployments.frontend.openai.http_edge import (
    check_auth,
    install_error_handlers,
    read_body,
    resolve_api_key,
    session_id_of,
)
from deployments.frontend.openai.loras import LoadLoraRequest, UnloadLoraRequest, unknown_model
from deployments.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from deployments.frontend.openai.replica import REPLICA_HEADER, Replica, Reply, RequestContext
from deployments.frontend.openai.tokenize import DetokenizeRequest, TokenizeRequest
from deployments.frontend.responses.api import ResponsesService
from deployments.frontend.responses.protocol import ResponsesRequest
from deployments.frontend.responses.routes import Parse, install_responses_routes
from deployments.frontend.responses.store import LocalStore, ResponseStore, Store
from deployments.frontend.routing.lora_paths import LoraPaths
from deployments.frontend.routing.prefix_key import chat_prefix, completion_prefix
from deployments.serve.handle_replica import EXPECTED_ERRORS, HandleReplica, as_api_error
from deployments.serve.responses_store_server import HandleStore

log = logging.getLogger(__name__)

_Req = TypeVar("_Req", bound=BaseModel)
# connect(session id or None) -> the replica methods, routed for that session
Connect = Callable[[str | None], Replica]


@dataclass(frozen=True)
class IngressConfig:
    model_name: str
    max_request_bytes: int = 1 << 20
    api_key: str | None = None  # None: $SHORTCONV_API_KEY in this process, else no auth
    responses_ttl_s: float = 3600.0  # stored Responses (deployments/frontend/responses/store.py)
    max_stored_responses: int = 10_000
    enable_lora: bool = False  # a `model` other than ours may name a replica's LoRA adapter
    runtime_lora_updating: bool = False  # serve /v1/load_lora_adapter and unload_lora_adapter


def build_ingress_app(connect: Connect, cfg: IngressConfig, store: Store | None = None) -> FastAPI:
    """Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (and GET /
    DELETE /v1/responses/{id}), /tokenize, /detokenize, /health, /v1/internal/stats,
    /v1/internal/reset_prefix_cache. `store` keeps stored responses (default: in this process,
    for `responses_ttl_s`, at most `max_stored_responses`)."""
    app = FastAPI(title="shortconv-serve", docs_url=None, redoc_url=None)
    api_key = resolve_api_key(cfg.api_key)
    install_error_handlers(app, as_api_error, EXPECTED_ERRORS)

    async def parse(request: Request, model: type[_Req]) -> _Req:
        check_auth(request, api_key)  # NOTE: first, so strangers cannot make us buffer
        data = parse_json_object(await read_body(request, cfg.max_request_bytes))
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        name = getattr(req, "model", None)
        if name == cfg.model_name:
            # NOTE: the base by its name is the base without one: one prefix key for both.
            req.model = None  # type: ignore[attr-defined]
        elif name and not cfg.enable_lora:
            raise unknown_model(name)
        # NOTE: with LoRA, the replica answers an unknown adapter (it knows which it holds).
        return req

    def replica(request: Request) -> Replica:
        check_auth(request, api_key)
        return connect(session_id_of(request))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        reply = await replica(request).models()  # NOTE: the adapters of that replica only
        return respond(Reply(reply.replica_id, loras.with_runtime_loads(reply.body)))

    loras = LoraPaths()

    def context(
        request: Request, prefix: tuple[int, ...], model: str | None
    ) -> tuple[Replica, RequestContext]:
        ctx = loras.context(session_id_of(request), prefix, model)
        return connect(ctx.session_id), ctx

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        target, ctx = context(request, completion_prefix(req), req.model)
        if req.stream:
            return await stream(target.completion_stream(req, ctx))
        return respond(await target.completion(req, ctx))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        target, ctx = context(request, chat_prefix(req), req.model)
        if req.stream:
            return await stream(target.chat_stream(req, ctx))
        return respond(await target.chat(req, ctx))

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        return respond(await replica(request).tokenize(await parse(request, TokenizeRequest)))

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        req = await parse(request, DetokenizeRequest)
        return respond(await replica(request).detokenize(req))

    @app.get("/health")
    async def health() -> Response:
        return respond(await connect(None).health())

    @app.get("/v1/internal/stats")
    async def stats(request: Request) -> Response:
        return respond(await replica(request).stats())  # NOTE: authorized: it lists sessions

    @app.post("/v1/internal/reset_prefix_cache", include_in_schema=False)  # admin, not an API
    async def reset_prefix_cache(request: Request) -> Response:
        return respond(await replica(request).reset_prefix_cache())

    if cfg.runtime_lora_updating:
        _install_lora_routes(app, parse, replica, loras)

    store = store or LocalStore(ResponseStore(cfg.responses_ttl_s, cfg.max_stored_responses))
    service = ResponsesService(connect, store, cfg.model_name, as_api_error, loras)
    install_responses_routes(
        app,
        service,
        parse,
        lambda r: check_auth(r, api_key),
        respond,
        {"openapi_extra": _body_schema(ResponsesRequest)},
    )
    _install_openapi(app, cfg)
    return app


def _install_lora_routes(
    app: FastAPI,
    parse: Parse,
    replica: Callable[[Request], Replica],
    loras: LoraPaths,
) -> None:
    """vLLM's runtime adapter routes (behind the API key, like every /v1 route). A load goes
    to the least-loaded replica, where the adapter then lives; an unload to its holder."""

    @app.post("/v1/load_lora_adapter", openapi_extra=_body_schema(LoadLoraRequest))
    async def load_lora_adapter(request: Request) -> Response:
        req = await parse(request, LoadLoraRequest)
        assert isinstance(req, LoadLoraRequest)
        ctx = RequestContext(lora_name=req.lora_name)  # the router records where it went
        reply = await replica(request).load_lora(req, ctx)
        loras.loaded(req.lora_name, req.lora_path)
        return respond(reply)

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body_schema(UnloadLoraRequest))
    async def unload_lora_adapter(request: Request) -> Response:
        req = await parse(request, UnloadLoraRequest)
        assert isinstance(req, UnloadLoraRequest)
        loras.unloaded(req.lora_name)  # NOTE: first: no request reloads it meanwhile
        ctx = RequestContext(lora_name=req.lora_name)  # the router sends it to a holder
        first = await replica(request).unload_lora(req, ctx)
        await _unload_other_holders(lambda: replica(request).unload_lora(req, ctx))
        return respond(first)


# More holders than replicas is impossible; this bounds the loop should a replica misreport.
_MAX_HOLDERS = 64


async def _unload_other_holders(unload: Callable[[], Awaitable[Reply]]) -> None:
    """Unload again until no replica holds the adapter (the 404 of a replica without it).
    A YAML adapter is on every replica, and a miss loads a runtime one on another: the
    router sends each call to a holder it has not sent this unload to yet."""
    for _ in range(_MAX_HOLDERS):
        try:
            await unload()
        except EXPECTED_ERRORS as exc:
            error = as_api_error(exc)
            if error.status == 404:
                return
            raise error from None


def respond(reply: Reply) -> JSONResponse:
    return JSONResponse(reply.body, headers={REPLICA_HEADER: reply.replica_id})


async def stream(replies: AsyncIterator[Reply]) -> Response:
    """An SSE response once the replica has admitted the request (its first chunk): a refusal
    before that is still an ordinary error status."""
    try:
        first = await anext(replies)
    except BaseException:
        await replies.aclose()  # type: ignore[attr-defined]
        raise
    headers = {"cache-control": "no-cache", REPLICA_HEADER: first.replica_id}
    return StreamingResponse(
        _events(first, replies), media_type="text/event-stream", headers=headers
    )


async def _events(first: Reply, replies: AsyncIterator[Reply]) -> AsyncIterator[str]:
    # NOTE: aclosing: a client that disconnects closes `replies`, which cancels the call.
    async with aclosing(replies):  # type: ignore[type-var]
        try:
            yield _event(first.body)
            async for reply in replies:
                yield _event(reply.body)
        except Exception as exc:  # the response has started: the status cannot change any more
            log.warning("stream from the replica broke: %s", exc)
            yield _event(as_api_error(exc).body())
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    content = {"application/json": {"schema": ref}}
    return {"requestBody": {"required": True, "content": content}}


def _install_openapi(app: FastAPI, cfg: IngressConfig) -> None:
    """/openapi.json with the request bodies the routes parse themselves (they take a raw
    Request, so FastAPI cannot see them); `model` is the one served name or absent (with
    LoRA: any name, since adapters come and go at run time)."""
    name = {"type": "string"} if cfg.enable_lora else {"const": cfg.model_name}
    lora_bodies = (LoadLoraRequest, UnloadLoraRequest) if cfg.runtime_lora_updating else ()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        comps = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (
            CompletionRequest,
            ChatCompletionRequest,
            ResponsesRequest,
            TokenizeRequest,
            DetokenizeRequest,
            *lora_bodies,
        ):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(schema.pop("$defs", {}))
            if "model" in schema["properties"]:
                schema["properties"]["model"] = {"anyOf": [name, {"type": "null"}]}
            comps[model.__name__] = schema
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    """The HTTP app, serving every request through LLMServer (`llm`); stored responses live in
    the ResponseStore deployment (`responses`) when given, else in this replica."""

    def __init__(
        self, llm: DeploymentHandle, cfg: dict[str, Any], responses: DeploymentHandle | None = None
    ) -> None:
        self.llm = llm
        self.cfg = IngressConfig(**cfg)
        self.store = HandleStore(responses) if responses is not None else None

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(lambda sid: HandleReplica(self.llm, sid), self.cfg, self.store)
