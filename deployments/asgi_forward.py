"""Run one forwarded HTTP request through an ASGI app in-process, as a stream of messages.

The ingress deployment reads the request, then calls `LLMServer.forward` through a handle (so
the LLMServer router sees the parsed request); this module is the replica's side: build the
ASGI scope, feed the body through `receive`, and yield what the app sends — the response start
first, then every body chunk as it comes (SSE stays incremental). When the caller goes away
(the handle call is cancelled), the app gets `http.disconnect` and, after a short grace, is
cancelled: either way the engine aborts the request and frees its slot (no Ray here).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
Headers = list[tuple[bytes, bytes]]
DISCONNECT_GRACE_S = 1.0  # a streaming response notices the disconnect itself within a step


@dataclass(frozen=True)
class ForwardedRequest:
    """What the ingress passes on, unchanged: enough to rebuild the ASGI scope."""

    method: str
    path: str
    query_string: bytes = b""
    headers: Headers = field(default_factory=list)
    body: bytes = b""
    root_path: str = ""
    client: tuple[str, int] | None = None

    def scope(self) -> Message:
        return {
            "type": "http",
            # NOTE: spec 2.3, so Starlette's StreamingResponse listens on `receive` for the
            # disconnect (2.4 would rely on `send` failing, which never happens in-process).
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": self.root_path,
            "query_string": self.query_string,
            "headers": list(self.headers),
            "client": self.client,
            "server": None,
        }


_END = object()


async def run_asgi(app: Any, req: ForwardedRequest) -> AsyncIterator[Message]:
    """Yield the app's `http.response.start` and `http.response.body` messages in order."""
    out: asyncio.Queue[Any] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(req.scope(), receive, send)
        finally:
            out.put_nowait(_END)

    task = asyncio.create_task(run())
    try:
        while (message := await out.get()) is not _END:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body"):
                break
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    finally:
        await _stop(task, gone)


async def _stop(task: asyncio.Task[None], gone: asyncio.Event) -> None:
    if not task.done():
        gone.set()
        await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class PrefixRecord:
    """The prefix hashes of requests this replica served, least recently used dropped first;
    reported to the router (`record_routing_stats`) as a sorted list, so the report changes
    only when a hash comes or goes. NOTE: a claim, not a promise: the engine may have evicted
    that prefix since; routing on a stale claim costs a prefill, never a wrong answer."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()

    def report(self) -> list[int]:
        return sorted(self._lru)

    def __len__(self) -> int:
        return len(self._lru)
