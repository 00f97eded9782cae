"""The Responses routes on the ingress app: `POST /v1/responses` (whole or streamed as typed
server-sent events, `event: <type>` + `data: {...}`, as OpenAI sends them; no `[DONE]`),
`GET` and `DELETE /v1/responses/{id}` for stored responses."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from deployments.frontend.openai.errors import ErrorOf
from deployments.frontend.openai.replica import REPLICA_HEADER, Reply
from deployments.frontend.responses.api import ResponsesService
from deployments.frontend.responses.protocol import ResponsesRequest
from deployments.frontend.responses.stream import Event

log = logging.getLogger(__name__)

Parse = Callable[[Request, type[BaseModel]], Awaitable[BaseModel]]


def install_responses_routes(
    app: FastAPI,
    service: ResponsesService,
    parse: Parse,
    authorize: Callable[[Request], None],
    respond: Callable[[Reply], JSONResponse],
    post_options: dict[str, Any],
) -> None:
    """`parse` reads and checks a body (auth, size, schema, model name) as for chat;
    `respond` answers a Reply (naming its replica); `post_options` document the body."""

    @app.post("/v1/responses", **post_options)
    async def create(request: Request) -> Response:
        req = await parse(request, ResponsesRequest)
        assert isinstance(req, ResponsesRequest)
        if not req.stream:
            return respond(await service.create(req))
        replica_id, events = await service.stream(req)
        headers = {"cache-control": "no-cache", REPLICA_HEADER: replica_id}
        return StreamingResponse(
            _sse(events, service.as_error), media_type="text/event-stream", headers=headers
        )

    @app.get("/v1/responses/{response_id}")
    async def get(request: Request, response_id: str) -> Response:
        authorize(request)
        return JSONResponse(await service.get(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        authorize(request)
        return JSONResponse(await service.delete(response_id))


async def _sse(events: AsyncIterator[Event], as_error: ErrorOf) -> AsyncIterator[str]:
    # NOTE: aclosing: a client that disconnects closes `events`, which cancels the replica call.
    async with aclosing(events):  # type: ignore[type-var]
        try:
            async for event in events:
                yield _frame(event)
        except Exception as exc:  # the response has started: the status cannot change any more
            log.warning("responses stream from the replica broke: %s", exc)
            err = as_error(exc)
            yield _frame({"type": "error", "code": err.code, "message": err.message, "param": None})


def _frame(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
