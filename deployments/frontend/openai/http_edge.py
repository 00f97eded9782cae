"""What only HTTP has, checked once at the ingress: the API key, the session header, the body
under its size limit, and every error as an OpenAI error object (`{"error": {...}}`)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.frontend.openai.errors import APIError

# Ray Serve routes on this header (RAY_SERVE_SESSION_ID_HEADER_KEY, default x-session-id) and
# compares it case-insensitively with '-' and '_' equivalent; the ingress reads it the same way.
SESSION_HEADER = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id")
MAX_SESSION_ID_LEN = 256
API_KEY_ENV = "SHORTCONV_API_KEY"


def resolve_api_key(configured: str | None) -> str | None:
    """The key clients must send: the `api_key` arg, else $SHORTCONV_API_KEY (read in the
    ingress's environment), else None (no auth). An empty value means unset."""
    return configured or os.environ.get(API_KEY_ENV) or None


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


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit`: from Content-Length
    before anything is read, else while streaming, so an oversized body is never buffered."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> APIError:
    return APIError(f"request body exceeds {limit} bytes", 413, code="request_too_large")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.headers)


def install_error_handlers(
    app: FastAPI, translate: Callable[[Exception], APIError], expected: tuple[type[Exception], ...]
) -> None:
    """Every error an OpenAI error object: FastAPI's (404, 405), and the `expected` ones and
    any other through `translate` (an APIError raised in a replica arrives wrapped by Ray)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(str(exc.errors()[0].get("msg", exc))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(str(exc.detail), exc.status_code, kind))

    async def _any(_: Request, exc: Exception) -> JSONResponse:
        return error_response(translate(exc))

    for kind in expected:
        app.add_exception_handler(kind, _any)
    # NOTE: a bug: still a 500 the client can read; Starlette re-raises it for the logs.
    app.add_exception_handler(Exception, _any)
