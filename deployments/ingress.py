"""OpenAIIngress: the HTTP entry point; forwards every request to LLMServer through a handle.

Why a hop at all: a Serve request router never sees an HTTP body (the proxy hands a replica
only the ASGI scope, and the body is pulled later), so routing on the prompt needs someone to
read the body first. This light deployment (no model, no torch) reads it, computes the prompt's
prefix key (deployments/prefix_key.py) and calls `LLMServer.forward` with the request unchanged
and the key as a kwarg, where SessionAffinityRouter sees both. The response comes back as it
is made: status and headers first (`x-shortconv-replica` included), then body chunks.

Errors here are OpenAI-shaped like LLMServer's: 413 for an oversized body (never buffered past
`max_request_bytes`), 503 + Retry-After when Serve refuses (back-pressure, no live replica).
A client that disconnects cancels the handle call, so the replica aborts and frees its slot.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from deployments.asgi_forward import ForwardedRequest, Message
from deployments.http_body import BodyTooLarge
from deployments.http_body import read_body as read_limited
from deployments.prefix_key import prefix_hashes

log = logging.getLogger(__name__)

# The same names and env var as deployments/openai_api.py, not imported: that module pulls in
# the engine (torch), which this process never needs.
SESSION_HEADER = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id")
MAX_SESSION_ID_LEN = 256
API_KEY_ENV = "SHORTCONV_API_KEY"
RETRY_AFTER_S = 1
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
# LLMServer's routes, named here too only so Serve's per-route HTTP metrics and logs keep their
# paths; every other path goes through the catch-all to LLMServer all the same (its 404s).
KNOWN_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/openapi.json",
    "/v1/internal/stats",
    "/v1/internal/reset_prefix_cache",
)

# forwarder(request, session id or None, prefix hashes) -> the replica's ASGI messages
Forwarder = Callable[[ForwardedRequest, str | None, list[int]], Any]


@dataclass(frozen=True)
class IngressConfig:
    max_request_bytes: int = 1 << 20
    api_key: str | None = None  # None: $SHORTCONV_API_KEY in this process, else no auth


class Refused(Exception):
    """An OpenAI-shaped error answered by the ingress itself."""

    def __init__(self, status: int, message: str, kind: str, code: str, retry: bool) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.retry = status, kind, code, retry

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}
        }

    def response(self) -> JSONResponse:
        headers = {"retry-after": str(RETRY_AFTER_S)} if self.retry else None
        return JSONResponse(self.body(), self.status, headers=headers)


def session_id_of(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Serve's rule: the header name compared case-insensitively, '-' and '_' equal. A bad
    value is not routed on; LLMServer answers it (400)."""
    want = SESSION_HEADER.lower().replace("-", "_")
    for key, value in headers:
        if key.decode("latin-1").lower().replace("-", "_") == want:
            sid = value.decode("latin-1")
            return sid if 0 < len(sid) <= MAX_SESSION_ID_LEN else None
    return None


def authorized(request: Request, api_key: str | None) -> bool:
    if api_key is None:
        return True
    auth = request.headers.get("authorization", "")
    return hmac.compare_digest(auth.encode(), f"Bearer {api_key}".encode())


async def read_body(request: Request, limit: int) -> bytes:
    try:
        return await read_limited(request, limit)
    except BodyTooLarge as exc:
        raise _too_large(exc.limit) from None


def _too_large(limit: int) -> Refused:
    msg = f"request body exceeds {limit} bytes"
    return Refused(413, msg, "invalid_request_error", "request_too_large", retry=False)


def translate(exc: BaseException) -> Refused:
    """Serve's refusals before a response started, as OpenAI 503s a client retries."""
    if isinstance(exc, BackPressureError):
        return Refused(503, exc.message, "server_overloaded", "overloaded", retry=True)
    if isinstance(exc, (DeploymentUnavailableError, RayActorError)):
        msg = f"no replica could take the request: {type(exc).__name__}"
        return Refused(503, msg, "server_error", "replica_unavailable", retry=True)
    log.exception("forwarding failed", exc_info=exc)
    msg = f"internal error: {type(exc).__name__}"
    return Refused(500, msg, "server_error", "internal_error", retry=False)


def build_ingress_app(forward: Forwarder, cfg: IngressConfig) -> FastAPI:
    """Every path relays to LLMServer, which owns them all (its 404s, /openapi.json, /health)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None

    async def relay(request: Request) -> Response:
        scope = request.scope
        # NOTE: a request that fails auth is not read: LLMServer checks auth before the body
        # and answers 401, so strangers cannot make either process buffer.
        try:
            body = (
                await read_body(request, cfg.max_request_bytes)
                if authorized(request, api_key)
                else b""
            )
        except Refused as exc:
            return exc.response()
        headers = list(scope["headers"])
        req = ForwardedRequest(
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=headers,
            body=body,
            root_path=scope.get("root_path", ""),
            client=tuple(scope["client"]) if scope.get("client") else None,  # type: ignore[arg-type]
        )
        return await _start(
            forward, req, session_id_of(headers), prefix_hashes(req.method, req.path, body)
        )

    for path in (*KNOWN_PATHS, "/{path:path}"):
        app.add_api_route(path, relay, methods=METHODS)
    return app


async def _start(
    forward: Forwarder, req: ForwardedRequest, sid: str | None, hashes: list[int]
) -> Response:
    """Wait for the replica's response start; a replica that died before it is retried once
    (nothing was generated yet), any other refusal is answered here."""
    for attempt in range(2):
        messages = forward(req, sid, hashes)
        try:
            start: Message = await messages.__anext__()
            break
        except RayActorError as exc:
            _cancel(messages)
            if attempt == 1:
                return translate(exc).response()
        except Exception as exc:
            _cancel(messages)
            return translate(exc).response()
    headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
    sse = any(
        k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers
    )
    resp = StreamingResponse(_body(messages, sse), status_code=int(start["status"]))
    resp.raw_headers = headers
    return resp


async def _body(messages: Any, sse: bool) -> AsyncIterator[bytes]:
    finished = False
    try:
        async for message in messages:
            if message.get("body"):
                yield message["body"]
        finished = True
    except Exception as exc:  # the response has started: the status cannot change any more
        log.warning("stream from the replica broke: %s", exc)
        finished = True
        if sse:  # as LLMServer ends a failed stream: one error event, then [DONE]
            err = translate(exc)
            body = {
                "error": {"message": str(err), "type": err.kind, "param": None, "code": err.code}
            }
            yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
    finally:
        if not finished:
            _cancel(messages)  # the client left: the replica aborts and frees the slot


def _cancel(messages: Any) -> None:
    cancel = getattr(messages, "cancel", None)
    if cancel is not None:
        cancel()


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    """Reads each HTTP request, keys its prompt, forwards it to LLMServer (`llm`)."""

    def __init__(self, llm: DeploymentHandle, cfg: dict[str, Any] | None = None) -> None:
        self.llm = llm
        self.cfg = IngressConfig(**(cfg or {}))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self._forward, self.cfg)

    def _forward(self, req: ForwardedRequest, sid: str | None, hashes: list[int]) -> Any:
        # NOTE: session_id through the handle options: the LLMServer router reads it from the
        # request metadata exactly as it does for the proxy's x-session-id.
        handle = (
            self.llm.options(stream=True, session_id=sid) if sid else self.llm.options(stream=True)
        )
        return handle.forward.remote(req, prefix_hashes=hashes)
