"""The OpenAI-compatible FastAPI app around an AsyncEngine (no Ray here: testable on its own).

Every error is OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`) and bad input
never reaches the engine: auth, body size, JSON, schema, model name, sampling fields and the
context length are all checked first. Auth (`api_key` or $SHORTCONV_API_KEY) covers /v1/*;
/health (probes) and /openapi.json (the request schemas, no data) are open.
"""

from __future__ import annotations

import hmac
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.async_engine import AsyncEngine, EngineDead, EngineOverloaded
from deployments.http_body import BodyTooLarge
from deployments.http_body import read_body as read_limited
from deployments.openai_format import Formatter, collect, with_deadline
from deployments.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_context,
    from_validation_error,
    parse_json_object,
)
from deployments.openai_tools import ToolPlan, chat_grammar, plan_tools
from deployments.tool_parsers import parser_for_template
from deployments.tool_stream import special_pattern
from shortconv.sampling.grammar import GrammarError
from shortconv.sampling.sampling_params import SamplingParams

# Ray Serve routes on this header (RAY_SERVE_SESSION_ID_HEADER_KEY, default x-session-id) and
# compares it case-insensitively with '-' and '_' equivalent; the replica reads it the same way.
SESSION_HEADER = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id")
REPLICA_HEADER = "x-shortconv-replica"
MAX_SESSION_ID_LEN = 256
API_KEY_ENV = "SHORTCONV_API_KEY"
RETRY_AFTER_S = 1  # what a 503 tells clients to wait: a queue slot frees within a few steps

_Req = TypeVar("_Req", bound=BaseModel)


@dataclass(frozen=True)
class ApiConfig:
    model_name: str
    replica_id: str = "local"
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    request_timeout_s: float = 600.0  # from queueing to the last token; then aborted


def resolve_api_key(configured: str | None) -> str | None:
    """The key clients must send: the `api_key` arg, else $SHORTCONV_API_KEY (read in the
    replica's environment), else None (no auth). An empty value means unset."""
    return configured or os.environ.get(API_KEY_ENV) or None


def session_id_of(request: Request) -> str | None:
    want = SESSION_HEADER.lower().replace("-", "_")
    for key, value in request.headers.items():
        if key.lower().replace("-", "_") == want:
            if not value or len(value) > MAX_SESSION_ID_LEN:
                raise APIError(
                    f"{SESSION_HEADER} must be 1..{MAX_SESSION_ID_LEN} characters",
                    param=SESSION_HEADER,
                )
            return value
    return None


def build_openai_app(engine: AsyncEngine, cfg: ApiConfig) -> FastAPI:
    """Routes: /v1/models, /v1/completions, /v1/chat/completions, /health, /v1/internal/stats,
    /v1/internal/reset_prefix_cache."""
    app = FastAPI(title="shortconv-serve", docs_url=None, redoc_url=None)
    created = int(time.time())
    tokenizer = engine.engine.tokenizer
    max_model_len = int(engine.engine.max_model_len)
    hf = getattr(tokenizer, "hf", None)
    tool_parser = parser_for_template(getattr(hf, "chat_template", None))
    specials = [t.content for t in getattr(hf, "added_tokens_decoder", {}).values() if t.special]
    keep = (tool_parser.start, tool_parser.end) if tool_parser is not None else ()
    drop_specials = special_pattern(specials, keep)
    _install_error_handlers(app)

    app.add_middleware(_TagReplica, replica_id=cfg.replica_id)

    async def parse(request: Request, model: type[_Req]) -> _Req:
        check_auth(request, cfg.api_key)  # NOTE: first, so strangers cannot make us buffer
        data = parse_json_object(await read_body(request, cfg.max_request_bytes))
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        name = getattr(req, "model", None)
        if name and name != cfg.model_name:
            raise APIError(f"the model {name!r} does not exist", 404, code="model_not_found")
        return req

    def token_text(tok: int) -> str:
        if tokenizer is None:
            return f"token_id:{tok}"
        return tokenizer.decode([tok], skip_special_tokens=False)

    async def respond(
        request: Request,
        chat: bool,
        prompt: list[int],
        params: SamplingParams,
        include_usage: bool,
        stream: bool,
        grammar_param: str = "response_format",
        tools: ToolPlan | None = None,
    ) -> Response:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        check_context(len(prompt), params.max_tokens, max_model_len)
        retry = {"retry-after": str(RETRY_AFTER_S)}
        try:
            deltas = engine.generate(prompt, params, rid, session_id_of(request))
        except GrammarError as exc:  # a schema that passed our checks but does not compile
            raise APIError(str(exc), param=grammar_param) from None
        except ValueError as exc:  # the engine's own checks: prompt length, ids, stop strings
            raise APIError(str(exc), param="stop" if "stop" in str(exc) else "prompt") from None
        except EngineOverloaded as exc:
            raise APIError(
                str(exc), 503, "server_overloaded", code="overloaded", headers=retry
            ) from None
        except EngineDead as exc:
            raise APIError(
                str(exc), 503, "server_error", code="engine_dead", headers=retry
            ) from None
        deltas = with_deadline(deltas, cfg.request_timeout_s)
        fmt = Formatter(
            chat,
            rid,
            cfg.model_name,
            token_text,
            params.logprobs is not None,
            tools=tools,
            drop_specials=drop_specials if tools is not None and tools.mode == "auto" else None,
        )
        if stream:
            return StreamingResponse(
                fmt.sse(deltas, include_usage),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        return JSONResponse(fmt.whole(await collect(deltas)))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request, cfg.api_key)
        card = {"id": cfg.model_name, "object": "model", "created": created}
        card.update(owned_by="shortconv-serve", max_model_len=max_model_len)
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError("this model has no tokenizer: send token ids", param="prompt")
            try:
                prompt = tokenizer.encode(prompt)
            except Exception as exc:  # a string the tokenizer cannot take is the client's
                raise APIError(f"prompt cannot be tokenized: {exc}", param="prompt") from None
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        grammar = req.response_format.grammar() if req.response_format else None
        params = req.sampling(max_tokens=max_tokens, logprobs=req.logprobs, grammar=grammar)
        return await respond(request, False, prompt, params, req.include_usage, req.stream)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        if tokenizer is None:
            raise APIError("this model has no tokenizer, so no chat template", param="messages")
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser)
        grammar, grammar_param = chat_grammar(req.response_format, tools)
        try:
            listed = req.template_tools()
            prompt = tokenizer.apply_chat_template(
                req.chat_messages(),
                add_generation_prompt=req.add_generation_prompt,
                **({"tools": listed} if listed else {}),
            )
        except APIError:
            raise
        except Exception as exc:  # jinja errors: the template refused these messages
            raise APIError(f"chat template failed: {exc}", param="messages") from None
        requested = req.requested_max_tokens()
        max_tokens = requested if requested is not None else max(1, max_model_len - len(prompt))
        params = req.sampling(
            max_tokens=max_tokens,
            logprobs=req.engine_logprobs(),
            grammar=grammar,
            # NOTE: `auto` parses the model's call markers, which are special tokens.
            skip_special_tokens=tools is None or tools.mode != "auto",
        )
        return await respond(
            request, True, prompt, params, req.include_usage, req.stream, grammar_param, tools
        )

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:
            err = APIError(f"unhealthy: {exc}", 503, "server_error", code="unhealthy")
            return JSONResponse(err.body(), err.status)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/internal/stats")
    async def stats(request: Request) -> dict[str, Any]:
        check_auth(request, cfg.api_key)  # it lists session ids
        return {"replica_id": cfg.replica_id, **engine.stats()}

    @app.post("/v1/internal/reset_prefix_cache", include_in_schema=False)  # admin, not an API
    async def reset_prefix_cache(request: Request) -> dict[str, Any]:
        """Drop this replica's prefix cache (kept sessions too); running requests keep their
        own state. vLLM's /reset_prefix_cache, per replica."""
        check_auth(request, cfg.api_key)
        return {"replica_id": cfg.replica_id, "dropped": await engine.flush_prefix_cache()}

    _install_openapi(app, cfg.model_name)
    return app


async def read_body(request: Request, limit: int) -> bytes:
    """The body under `limit` (deployments/http_body.py), else an OpenAI 413."""
    try:
        return await read_limited(request, limit)
    except BodyTooLarge as exc:
        raise _too_large(exc.limit) from None


def _too_large(limit: int) -> APIError:
    return APIError(f"request body exceeds {limit} bytes", 413, code="request_too_large")


def check_auth(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    auth = request.headers.get("authorization", "")
    # NOTE: constant time over the secret, so response timing does not leak its prefix.
    if not hmac.compare_digest(auth.encode(), f"Bearer {api_key}".encode()):
        raise APIError(
            "invalid API key",
            401,
            "authentication_error",
            code="invalid_api_key",
            headers={"www-authenticate": "Bearer"},
        )


class _TagReplica:
    """Pure ASGI middleware (no response buffering, so streams and disconnects pass through)
    that names the serving replica in a response header."""

    def __init__(self, app: Any, replica_id: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    content = {"application/json": {"schema": ref}}
    return {"requestBody": {"required": True, "content": content}}


def _install_openapi(app: FastAPI, model_name: str) -> None:
    """/openapi.json with the request bodies the routes parse themselves (they take a raw
    Request, so FastAPI cannot see them); `model` is the one served name or absent."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        comps = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatCompletionRequest):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(schema.pop("$defs", {}))
            schema["properties"]["model"] = {"anyOf": [{"const": model_name}, {"type": "null"}]}
            comps[model.__name__] = schema
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _install_error_handlers(app: FastAPI) -> None:
    def reply(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return reply(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return reply(APIError(str(exc.errors()[0].get("msg", exc))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return reply(APIError(str(exc.detail), exc.status_code, kind))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: still OpenAI-shaped, and named for the logs.
        why = f"internal error: {type(exc).__name__}"
        return reply(APIError(why, 500, "server_error", code="internal_error"))
