"""OpenAI response bodies (completions and chat, whole and streamed) built from engine deltas.
Streamed bodies are the JSON objects of the SSE events; the ingress frames them. One request
may have several choices (a completions batch: one per prompt), each fed by its own engine
request; `choices[i].index` says which, and usage sums them."""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from deployments.frontend.engine.engine_types import Delta
from deployments.frontend.openai.deltas import Accumulator, usage_of
from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.tools import ToolPlan, openai_tool_calls
from deployments.frontend.tools.stream import CallDelta, ToolOutput
from shortconv.engine.outputs import FinishReason

# The engine's finish reasons that OpenAI has no word for end as "stop".
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "stop"}
# Finish reasons that end a request without an answer.
_FAILED = (FinishReason.ERROR, FinishReason.TIMEOUT)


def engine_error(message: str | None) -> APIError:
    return APIError(message or "generation failed", 500, "server_error", code="engine_error")


def failure(reason: str | None, message: str | None) -> APIError:
    """The error a failed request reports: the engine's (500) or our deadline's (504)."""
    if reason == FinishReason.TIMEOUT:
        return APIError(message or "timed out", 504, "timeout_error", code="request_timeout")
    return engine_error(message)


@dataclass(frozen=True)
class StreamUsage:
    """`stream_options`: usage in a last chunk of its own; with `continuous`, in every chunk."""

    include: bool = False
    continuous: bool = False


@dataclass(frozen=True)
class Formatter:
    """Shapes one request's responses; `chat` picks chat.completion over text_completion."""

    chat: bool
    request_id: str
    model: str
    token_text: Any  # Callable[[int], str]: one token's text for logprobs
    want_logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None  # chat with tools: content and calls split (tool_stream)
    drop_specials: re.Pattern[str] | None = None
    echo: tuple[str, ...] = ()  # completions' `echo`: each choice's prompt text, in front

    def _tool_output(self) -> ToolOutput | None:
        return ToolOutput(self.tools, self.drop_specials) if self.tools is not None else None

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(
        self, ids: Sequence[int], lps: Any, tops: Any, offset: int = 0
    ) -> dict[str, Any] | None:
        if not self.want_logprobs or not ids:
            return None
        toks = [self.token_text(t) for t in ids]
        top = [
            [(self.token_text(t), lp) for t, lp in (row or ())] for row in (tops or [()] * len(ids))
        ]
        if self.chat:
            return {
                "content": [
                    {**_chat_lp(s, lp), "top_logprobs": [_chat_lp(ts, tl) for ts, tl in row]}
                    for s, lp, row in zip(toks, lps, top, strict=True)
                ]
            }
        offsets, pos = [], offset
        for s in toks:
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": toks,
            "token_logprobs": list(lps),
            "top_logprobs": [dict(row) for row in top] if tops else None,
            "text_offset": offsets,
        }

    # ---- whole responses ----------------------------------------------------------------------
    def whole(self, *accs: Accumulator) -> dict[str, Any]:
        """The response body over every choice's totals (in choice order)."""
        for acc in accs:
            if acc.finish_reason in _FAILED:
                raise failure(acc.finish_reason, acc.error)
        choices = [self._whole_choice(i, acc) for i, acc in enumerate(accs)]
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": usage_of(accs)}

    def _whole_choice(self, index: int, acc: Accumulator) -> dict[str, Any]:
        echo = self.echo[index] if self.echo else ""
        lp = self._logprobs(acc.token_ids, acc.logprobs, acc.top_logprobs or None, len(echo))
        choice: dict[str, Any] = {"index": index, "logprobs": lp}
        choice["finish_reason"] = _FINISH.get(acc.finish_reason or FinishReason.STOP, "stop")
        if not self.chat:
            choice["text"] = echo + acc.text
            return choice
        choice["message"] = {"role": "assistant", "content": acc.text}
        tools = self._tool_output()
        if tools is not None:
            head = tools.push(acc.text)
            rest, calls = tools.finish(acc.finish_reason)
            content = head + rest
            if calls:
                choice["message"] = {
                    "role": "assistant",
                    "content": content.strip() or None,
                    "tool_calls": openai_tool_calls(calls, stream=False),
                }
                choice["finish_reason"] = "tool_calls"
            else:
                choice["message"]["content"] = content
        return choice

    # ---- streams ------------------------------------------------------------------------------
    async def chunks(
        self,
        deltas: AsyncIterator[tuple[int, Delta]],
        accs: Sequence[Accumulator],
        usage: StreamUsage,
    ) -> AsyncIterator[dict[str, Any]]:
        """The streamed chunks (an error becomes an error object, and the last one)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        stream = _ChoiceStreams(self, accs, usage)
        if self.chat:
            for i in range(len(accs)):
                first = {"index": i, "delta": {"role": "assistant", "content": ""}}
                first.update(logprobs=None, finish_reason=None)
                yield {**self._head(obj), "choices": [first], **stream.usage_field()}
        async with contextlib.aclosing(deltas) as it:  # type: ignore[type-var]
            async for i, d in it:
                if d.finish_reason in _FAILED:
                    accs[i].add(d)
                    yield failure(d.finish_reason, d.error).body()
                    return
                choice = stream.choice(i, d)
                if choice is not None:
                    yield {**self._head(obj), "choices": [choice], **stream.usage_field()}
        if usage.include and all(a.finish_reason is not None for a in accs):
            yield {**self._head(obj), "choices": [], "usage": usage_of(accs)}


class _ChoiceStreams:
    """Per-choice state of one stream: totals, tool-call splitting, call ids, echo."""

    def __init__(self, fmt: Formatter, accs: Sequence[Accumulator], usage: StreamUsage) -> None:
        self.fmt, self.accs, self.usage = fmt, accs, usage
        self.tools = [fmt._tool_output() for _ in accs]
        self.call_ids: dict[tuple[int, int], str] = {}
        self.echo_due = [bool(fmt.echo)] * len(accs)

    def usage_field(self) -> dict[str, Any]:
        if not self.usage.include:
            return {}
        return {"usage": usage_of(self.accs) if self.usage.continuous else None}

    def choice(self, i: int, d: Delta) -> dict[str, Any] | None:
        """Choice i's part of one chunk, or None when the delta shows nothing yet."""
        fmt, acc, tools = self.fmt, self.accs[i], self.tools[i]
        offset = len(acc.text)
        acc.add(d)
        finish = _FINISH.get(d.finish_reason, "stop") if d.finish_reason else None
        text, calls = d.text, []
        if tools is not None:
            text, calls = tools.push(d.text), tools.stream_calls()
            if finish:
                rest, done, tail = tools.finish_stream(d.finish_reason)
                text, calls = text + rest, calls + tail
                finish = "tool_calls" if done else finish
        head = ""
        if self.echo_due[i]:
            head, self.echo_due[i] = fmt.echo[i], False
        if not (text or head or calls or finish or fmt.want_logprobs):
            return None  # a token with no visible text yet (held back, special or partial)
        choice: dict[str, Any] = {"index": i}
        if fmt.chat:
            choice["delta"] = {"content": text} if text else {}
            if calls:
                choice["delta"]["tool_calls"] = [self._call(i, c) for c in calls]
        else:
            choice["text"] = head + text
        echo_len = len(fmt.echo[i]) if fmt.echo else 0
        lps = d.logprobs or ()
        choice["logprobs"] = fmt._logprobs(d.token_ids, lps, d.top_logprobs, offset + echo_len)
        choice["finish_reason"] = finish
        return choice

    def _call(self, i: int, c: CallDelta) -> dict[str, Any]:
        """OpenAI's streamed call delta: id, type and name on a call's first one only."""
        out: dict[str, Any] = {"index": c.index, "function": {"arguments": c.arguments}}
        if c.name is not None:
            call_id = self.call_ids.setdefault((i, c.index), f"call_{uuid.uuid4().hex[:24]}")
            out.update(id=call_id, type="function")
            out["function"] = {"name": c.name, "arguments": c.arguments}
        return out


def _chat_lp(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
