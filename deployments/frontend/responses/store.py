"""Stored responses (`store: true`): the response object, its whole conversation and the session
that keeps its state, for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`.

The app keeps them in one place for every ingress replica
(deployments/serve/responses_store_server.py,
a one-replica deployment); a test's in-process app keeps them in its own process (`LocalStore`).
A conversation is one session: its first response's id is the session id every later turn is
routed and served under (deployments/frontend/responses/api.py), so the next turn lands on the
replica holding its state. The store keeps the conversation as chat messages too, so a turn whose
owner is gone is re-prefilled from it elsewhere; its images are kept once each by digest, as
bytes, and its messages name them (deployments/frontend/responses/images.py), never a data URL.
Entries live `ttl_s` after they were stored and at most `max_entries` at once (the oldest go
first); an expired id is remembered (as many as `max_entries`) so its 404 can say it expired
rather than that it never existed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from deployments.frontend.openai.errors import APIError
from deployments.frontend.responses.images import StoredImage

Body = dict[str, Any]  # a response object
Messages = list[dict[str, Any]]  # a conversation, as chat messages
Images = Mapping[str, StoredImage]


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as `GET` returns it
    messages: tuple[dict[str, Any], ...]  # the conversation through this response, as chat
    session_id: str  # the conversation's session (its first response's id)
    stored_at: float
    images: Images = field(default_factory=dict)  # digest -> image, for the messages' references


class Store(Protocol):
    """What the Responses service needs of a store: ResponseStore in this process
    (`LocalStore`), or the app's one ResponseStore deployment, shared by every ingress replica
    (deployments/serve/responses_store_server.py)."""

    async def put(
        self, body: Body, messages: Messages, session_id: str, images: Images | None = None
    ) -> None: ...
    async def get(self, response_id: str, param: str | None = None) -> StoredResponse: ...
    async def delete(self, response_id: str) -> None: ...


class LocalStore:
    """`Store` over a ResponseStore in this process."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def put(
        self, body: Body, messages: Messages, session_id: str, images: Images | None = None
    ) -> None:
        self.store.put(body, messages, session_id, images)

    async def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        return self.store.get(response_id, param)

    async def delete(self, response_id: str) -> None:
        self.store.delete(response_id)


class ResponseStore:
    def __init__(
        self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.max_entries, self.clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._expired: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, body: Body, messages: Messages, session_id: str, images: Images | None = None
    ) -> None:
        self._purge()
        entry = StoredResponse(body, tuple(messages), session_id, self.clock(), dict(images or {}))
        self._entries[body["id"]] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)  # NOTE: evicted by the bound: "not found"

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry, or a 404 error object (`param` names the field that sent the id)."""
        self._purge()
        entry = self._entries.get(response_id)
        if entry is not None:
            return entry
        why = "expired" if response_id in self._expired else "was not found"
        raise APIError(
            f"response {response_id!r} {why} (stored responses live {self.ttl_s:g} s)",
            404,
            "not_found_error",
            param=param,
            code="response_not_found",
        )

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def _purge(self) -> None:
        """Drop the entries past their TTL (the oldest first: insertion order is age)."""
        now = self.clock()
        while self._entries:
            rid, entry = next(iter(self._entries.items()))
            if now - entry.stored_at < self.ttl_s:
                break
            del self._entries[rid]
            self._expired[rid] = None
            if len(self._expired) > self.max_entries:
                self._expired.popitem(last=False)
