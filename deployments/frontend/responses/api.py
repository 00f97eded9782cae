"""The Responses API at the ingress: each `POST /v1/responses` becomes a chat call on a replica
(deployments/frontend/responses/convert.py) under the conversation's session, and its answer a
response.

A stored conversation is a session (deployments/frontend/responses/store.py): its first response's
id is the session id of every later turn, so SessionAffinityRouter sends a turn naming
`previous_response_id` to the replica that holds the conversation's state, exactly as it sends
an `x-session-id` turn, and the engine resumes from the kept checkpoint there (the turn's
`usage.input_tokens_details.cached_tokens` covers the earlier turns). The prompt is always the
whole conversation, so where that replica is gone another one prefills it in full.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from deployments.frontend.openai.errors import ErrorOf
from deployments.frontend.openai.protocol import ChatCompletionRequest
from deployments.frontend.openai.replica import Replica, Reply, RequestContext
from deployments.frontend.responses.convert import (
    assistant_turn,
    chat_request,
    input_messages,
    new_id,
    output_items,
    renamed,
    usage_of,
)
from deployments.frontend.responses.images import restore, stash
from deployments.frontend.responses.protocol import ResponsesRequest
from deployments.frontend.responses.store import Images, Store
from deployments.frontend.responses.stream import Event, ResponseEvents
from deployments.frontend.routing.lora_paths import LoraPaths
from deployments.frontend.routing.prefix_key import chat_prefix

Connect = Callable[[str | None], Replica]


@dataclass(frozen=True)
class _Turn:
    """One request, planned: its id, the conversation through its input (earlier turns' images
    as references into `images`), and its session."""

    request: ResponsesRequest
    response_id: str
    created_at: int
    messages: list[dict[str, Any]]
    session_id: str | None
    chat: ChatCompletionRequest
    images: Images

    def response(
        self, model: str, items: list[dict[str, Any]], usage: dict[str, Any], status: str
    ) -> dict[str, Any]:
        req = self.request
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": model,
            "output": items,
            "usage": usage,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": _choice(req),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": {"format": _format(req)},
            "store": req.store,
            "metadata": req.metadata or {},
        }


def _choice(req: ResponsesRequest) -> str | dict[str, Any]:
    choice = req.tool_choice
    return (
        choice.model_dump()
        if choice is not None and not isinstance(choice, str)
        else (choice or "auto")
    )


def _format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text_format()
    return fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}


class ResponsesService:
    """Create (whole or streamed), get and delete responses over the replicas.

    `as_error` names what a replica call raised as an APIError; the transport that `connect`
    returns knows its own failures (Ray's, for the Serve layer), so it is given here, once."""

    def __init__(
        self,
        connect: Connect,
        store: Store,
        model_name: str,
        as_error: ErrorOf,
        loras: LoraPaths | None = None,
    ) -> None:
        self.connect, self.store, self.model_name = connect, store, model_name
        self.loras = loras or LoraPaths()  # runtime-loaded adapters' directories (load on miss)
        self.as_error = as_error

    async def plan(self, req: ResponsesRequest) -> _Turn:
        history: list[dict[str, Any]] = []
        session: str | None = None
        images: Images = {}
        if req.previous_response_id is not None:
            prev = await self.store.get(req.previous_response_id, param="previous_response_id")
            history, session, images = list(prev.messages), prev.session_id, prev.images
        rid = new_id("resp")
        if session is None and req.store:
            session = rid  # NOTE: a new conversation's session is its first response's id
        new = input_messages(req)
        # NOTE: only the stored history's references resolve: a client's own `sha256:` URL
        # is a URL like any other (and refused by the replica's scheme check).
        chat = chat_request(req, restore(history, images) + new)
        return _Turn(req, rid, int(time.time()), history + new, session, chat, images)

    def _replica(self, turn: _Turn) -> tuple[Replica, RequestContext]:
        ctx = self.loras.context(turn.session_id, chat_prefix(turn.chat), turn.chat.model)
        return self.connect(turn.session_id), ctx

    async def create(self, req: ResponsesRequest) -> Reply:
        turn = await self.plan(req)
        target, ctx = self._replica(turn)
        try:
            reply = await target.chat(turn.chat, ctx)
        except Exception as exc:  # the replica's refusal (wrapped by Ray), named for Responses
            raise renamed(self.as_error(exc)) from None
        choice = reply.body["choices"][0]
        items = output_items(choice["message"])
        status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        body = turn.response(self._name(turn), items, usage_of(reply.body.get("usage")), status)
        await self._keep(turn, body)
        return Reply(reply.replica_id, body)

    async def stream(self, req: ResponsesRequest) -> tuple[str, AsyncIterator[Event]]:
        """(the serving replica, the events); a refusal raises here, before any event."""
        turn = await self.plan(req)
        target, ctx = self._replica(turn)
        replies = target.chat_stream(turn.chat, ctx)
        try:
            first = await anext(replies)
        except Exception as exc:  # the replica's refusal (wrapped by Ray), named for Responses
            raise renamed(self.as_error(exc)) from None

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            async with aclosing(replies):  # type: ignore[type-var]
                yield first.body
                async for reply in replies:
                    yield reply.body

        return first.replica_id, self._events(turn, chunks())

    async def _events(
        self, turn: _Turn, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[Event]:
        finish = lambda items, usage, status: turn.response(self._name(turn), items, usage, status)
        events = ResponseEvents(
            turn.response(self._name(turn), [], usage_of(None), "in_progress"), finish
        )
        stream = events.events(chunks)
        # NOTE: aclosing both: a client that disconnects cancels the replica call at once.
        async with aclosing(chunks), aclosing(stream):  # type: ignore[type-var]
            async for event in stream:
                if event["type"] in ("response.completed", "response.incomplete"):
                    await self._keep(turn, event["response"])
                yield event

    def _name(self, turn: _Turn) -> str:
        """The model the response names: the request's LoRA adapter, else the base."""
        return turn.request.model or self.model_name

    async def _keep(self, turn: _Turn, body: dict[str, Any]) -> None:
        if turn.request.store and turn.session_id is not None:
            messages, added = stash([*turn.messages, assistant_turn(body["output"])])
            await self.store.put(body, messages, turn.session_id, {**turn.images, **added})

    async def get(self, response_id: str) -> dict[str, Any]:
        return (await self.store.get(response_id)).body

    async def delete(self, response_id: str) -> dict[str, Any]:
        await self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
