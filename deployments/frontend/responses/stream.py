"""A streamed chat answer as the Responses API's typed server-sent events.

Each event is `{"type": ..., "sequence_number": n, ...}` in the shapes of the `openai` client's
`openai.types.responses` events: `response.created` and `response.in_progress` first; a message
item (`output_item.added`, `content_part.added`, `output_text.delta`..., `output_text.done`,
`content_part.done`, `output_item.done`) while text decodes; a function_call item per tool call
(`output_item.added` with the name as soon as it is known, `function_call_arguments.delta` as
the arguments decode, `.done`, `output_item.done`); `response.completed` last. A failure after
the first event is an `error` event then `response.failed` (the status has been sent).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from deployments.frontend.responses.convert import call_item, message_item, new_id, usage_of

Event = dict[str, Any]
# (output items, usage, status) -> the response object
Finish = Callable[[list[dict[str, Any]], dict[str, Any], str], dict[str, Any]]


class ResponseEvents:
    """One response's events from its chat chunks; `items` and `usage` hold the result."""

    def __init__(self, skeleton: dict[str, Any], finish: Finish) -> None:
        self.skeleton, self.finish = skeleton, finish
        self.items: list[dict[str, Any]] = []
        self.usage: dict[str, Any] = usage_of(None)
        self.failed = False
        self.incomplete = False  # stopped at max_output_tokens
        self._seq = 0
        self._text: str | None = None  # the open message item's text so far
        self._calls: dict[int, int] = {}  # chat tool-call index -> output index

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[Event]:
        yield self._event("response.created", response=self.skeleton)
        yield self._event("response.in_progress", response=self.skeleton)
        async for chunk in chunks:
            for event in self._on_chunk(chunk):
                yield event
            if self.failed:
                return
        for event in self._close_all():
            yield event
        status = "incomplete" if self.incomplete else "completed"
        yield self._event(f"response.{status}", response=self.result(status))

    def result(self, status: str) -> dict[str, Any]:
        return self.finish(self.items, self.usage, status)

    def _on_chunk(self, chunk: dict[str, Any]) -> list[Event]:
        if "error" in chunk:
            self.failed = True
            err = chunk["error"]
            return [
                self._event("error", code=err.get("code"), message=err.get("message"), param=None),
                self._event("response.failed", response=self.result("failed")),
            ]
        if chunk.get("usage"):
            self.usage = usage_of(chunk["usage"])
        events: list[Event] = []
        for choice in chunk.get("choices") or ():
            self.incomplete |= choice.get("finish_reason") == "length"
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._on_text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._on_call(call)
        return events

    # ---- the message item ---------------------------------------------------------------
    def _on_text(self, text: str) -> list[Event]:
        events = []
        if self._text is None:
            events += self._open_message()
        self._text = (self._text or "") + text
        delta = self._event("response.output_text.delta", **self._at(), delta=text, logprobs=[])
        return [*events, delta]

    def _open_message(self) -> list[Event]:
        self._text = ""
        self.items.append(message_item("", new_id("msg"), "in_progress"))
        at = self._at()
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event(
                "response.output_item.added", output_index=at["output_index"], item=self.items[-1]
            ),
            self._event("response.content_part.added", **at, part=part),
        ]

    def _at(self) -> dict[str, Any]:
        """Where the open message's text goes."""
        index = len(self.items) - 1
        return {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}

    def _close_message(self) -> list[Event]:
        if self._text is None:
            return []
        text, at = self._text, self._at()
        self._text = None
        item = message_item(text, at["item_id"])
        self.items[at["output_index"]] = item
        part = item["content"][0]
        return [
            self._event("response.output_text.done", **at, text=text, logprobs=[]),
            self._event("response.content_part.done", **at, part=part),
            self._event("response.output_item.done", output_index=at["output_index"], item=item),
        ]

    # ---- function_call items ------------------------------------------------------------
    def _on_call(self, call: dict[str, Any]) -> list[Event]:
        index = call.get("index", 0)
        args = (call.get("function") or {}).get("arguments") or ""
        events: list[Event] = []
        if index not in self._calls:
            events += self._close_message()
            opened = call_item(
                {**call, "function": {**call["function"], "arguments": ""}},
                new_id("fc"),
                "in_progress",
            )
            self._calls[index] = len(self.items)
            self.items.append(opened)
            added = self._event(
                "response.output_item.added", output_index=len(self.items) - 1, item=dict(opened)
            )
            events.append(added)
        out = self._calls[index]
        if args:
            self.items[out]["arguments"] += args
            item_id = self.items[out]["id"]
            delta = self._event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=out,
                delta=args,
            )
            events.append(delta)
        return events

    def _close_all(self) -> list[Event]:
        events = self._close_message()
        for out in sorted(self._calls.values()):
            item = {**self.items[out], "status": "completed"}
            self.items[out] = item
            done = self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=out,
                name=item["name"],
                arguments=item["arguments"],
            )
            events += [done, self._event("response.output_item.done", output_index=out, item=item)]
        return events
