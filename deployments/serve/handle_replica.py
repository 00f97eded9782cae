"""The ingress's side of the typed hop: LLMServer's methods through its DeploymentHandle.

A replica that died before answering is tried once more (nothing reached the client yet); a
call the client gave up on (disconnect: the ingress's task is cancelled) is cancelled, so the
replica aborts the engine request and frees its slot. `as_api_error` turns whatever a call
raised into the OpenAI error the client gets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException
from ray.serve.handle import DeploymentHandle

from deployments.frontend.openai.errors import RETRY_AFTER_S, APIError
from deployments.frontend.openai.loras import LoadLoraRequest, UnloadLoraRequest
from deployments.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from deployments.frontend.openai.replica import Reply, RequestContext
from deployments.frontend.openai.tokenize import DetokenizeRequest, TokenizeRequest

log = logging.getLogger(__name__)

# What a call may raise that is not a bug: the replica's refusals and Serve's or Ray's.
EXPECTED_ERRORS: tuple[type[Exception], ...] = (APIError, RayError, RayServeException)


def as_api_error(exc: BaseException) -> APIError:
    """The replica's own APIError (Ray wraps it in a RayTaskError), Serve's refusals as 503s a
    client retries, anything else a 500 named for the logs."""
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    if isinstance(cause, APIError):
        return cause
    retry = {"retry-after": str(RETRY_AFTER_S)}
    if isinstance(exc, BackPressureError):
        return APIError(exc.message, 503, "server_overloaded", code="overloaded", headers=retry)
    if isinstance(exc, (DeploymentUnavailableError, RayActorError)):
        msg = f"no replica could take the request: {type(exc).__name__}"
        return APIError(msg, 503, "server_error", code="replica_unavailable", headers=retry)
    log.error("request failed", exc_info=exc)
    return APIError(f"internal error: {type(exc).__name__}", 500, "server_error", "internal_error")


class HandleReplica:
    """`Replica` (deployments/frontend/openai/replica.py) over a handle, for one request's
    session."""

    def __init__(self, handle: DeploymentHandle, session_id: str | None = None) -> None:
        # NOTE: the session id as a handle option: SessionAffinityRouter reads it from the
        # request metadata exactly as it does for the proxy's x-session-id.
        self._handle = handle.options(session_id=session_id) if session_id else handle

    async def chat(self, request: ChatCompletionRequest, ctx: RequestContext) -> Reply:
        return await _call(self._handle.chat, request, ctx=ctx)

    def chat_stream(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> AsyncIterator[Reply]:
        return _stream(self._handle.options(stream=True).chat_stream, request, ctx=ctx)

    async def completion(self, request: CompletionRequest, ctx: RequestContext) -> Reply:
        return await _call(self._handle.completion, request, ctx=ctx)

    def completion_stream(
        self, request: CompletionRequest, ctx: RequestContext
    ) -> AsyncIterator[Reply]:
        return _stream(self._handle.options(stream=True).completion_stream, request, ctx=ctx)

    async def tokenize(self, request: TokenizeRequest) -> Reply:
        return await _call(self._handle.tokenize, request)

    async def detokenize(self, request: DetokenizeRequest) -> Reply:
        return await _call(self._handle.detokenize, request)

    async def models(self) -> Reply:
        return await _call(self._handle.models)

    async def health(self) -> Reply:
        return await _call(self._handle.health)

    async def stats(self) -> Reply:
        return await _call(self._handle.stats)

    async def reset_prefix_cache(self) -> Reply:
        return await _call(self._handle.reset_prefix_cache)

    async def load_lora(self, request: LoadLoraRequest, ctx: RequestContext) -> Reply:
        return await _call(self._handle.load_lora, request, ctx=ctx)

    async def unload_lora(self, request: UnloadLoraRequest, ctx: RequestContext) -> Reply:
        return await _call(self._handle.unload_lora, request, ctx=ctx)


async def _call(method: DeploymentHandle, *args: Any, **kwargs: Any) -> Reply:
    for attempt in range(2):
        response = method.remote(*args, **kwargs)
        try:
            return await response
        except RayActorError:
            if attempt == 1:
                raise
        except asyncio.CancelledError:
            response.cancel()  # the client left: the replica aborts the engine request
            raise
    raise AssertionError("unreachable")


async def _stream(method: DeploymentHandle, *args: Any, **kwargs: Any) -> AsyncIterator[Reply]:
    for attempt in range(2):
        replies = method.remote(*args, **kwargs)
        try:
            first = await replies.__anext__()
            break
        except RayActorError:
            replies.cancel()
            if attempt == 1:
                raise
        except BaseException:
            replies.cancel()
            raise
    try:
        yield first
        async for reply in replies:
            yield reply
    finally:
        replies.cancel()  # the client left (or the stream ended: then a no-op)
