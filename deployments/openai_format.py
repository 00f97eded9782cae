"""OpenAI response bodies (completions and chat, whole and streamed) built from engine deltas.
Streamed bodies are the JSON objects of the SSE events; the ingress frames them."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deployments.engine_types import Delta
from deployments.openai_errors import APIError
from deployments.openai_tools import ToolPlan, openai_tool_calls
from deployments.tool_stream import ToolOutput
from shortconv.engine.outputs import FinishReason

# The engine's finish reasons that OpenAI has no word for end as "stop".
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "stop"}


@dataclass
class Accumulator:
    """Folds deltas into the totals a response needs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs or ())
        self.top_logprobs.extend(d.top_logprobs or ())
        self.num_prompt_tokens = d.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
        if d.finish_reason is not None:
            self.finish_reason, self.error = d.finish_reason, d.error

    def usage(self) -> dict[str, Any]:
        n = len(self.token_ids)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.num_prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


_FAILED = (
    FinishReason.ERROR,
    FinishReason.TIMEOUT,
)  # finish reasons that end a request without an answer


def engine_error(message: str | None) -> APIError:
    return APIError(message or "generation failed", 500, "server_error", code="engine_error")


def failure(reason: str | None, message: str | None) -> APIError:
    """The error a failed request reports: the engine's (500) or our deadline's (504)."""
    if reason == FinishReason.TIMEOUT:
        return APIError(message or "timed out", 504, "timeout_error", code="request_timeout")
    return engine_error(message)


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

    def _tool_output(self) -> ToolOutput | None:
        return ToolOutput(self.tools, self.drop_specials) if self.tools is not None else None

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(
        self, ids: list[int] | tuple[int, ...], lps: Any, tops: Any, offset: int = 0
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

    def whole(self, acc: Accumulator) -> dict[str, Any]:
        if acc.finish_reason in _FAILED:
            raise failure(acc.finish_reason, acc.error)
        lp = self._logprobs(acc.token_ids, acc.logprobs, acc.top_logprobs or None)
        choice: dict[str, Any] = {"index": 0, "logprobs": lp}
        choice["finish_reason"] = _FINISH.get(acc.finish_reason or FinishReason.STOP, "stop")
        if self.chat:
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
            body = self._head("chat.completion")
        else:
            choice["text"] = acc.text
            body = self._head("text_completion")
        return {**body, "choices": [choice], "usage": acc.usage()}

    async def chunks(
        self, deltas: AsyncIterator[Delta], include_usage: bool
    ) -> AsyncIterator[dict[str, Any]]:
        """The streamed chunks (an error becomes an error object, and the last one)."""
        acc = Accumulator()
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if include_usage else {}
        if self.chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            first.update(logprobs=None, finish_reason=None)
            yield {**self._head(obj), "choices": [first], **extra}
        async with contextlib.aclosing(deltas) as it:  # type: ignore[type-var]
            async for chunk in self._chunks(it, acc, obj, extra, self._tool_output()):
                yield chunk
        if acc.finish_reason not in (None, *_FAILED) and include_usage:
            yield {**self._head(obj), "choices": [], "usage": acc.usage()}

    async def _chunks(
        self,
        deltas: AsyncIterator[Delta],
        acc: Accumulator,
        obj: str,
        extra: dict[str, Any],
        tools: ToolOutput | None,
    ) -> AsyncIterator[dict[str, Any]]:
        async for d in deltas:
            offset = len(acc.text)
            acc.add(d)
            if d.finish_reason in _FAILED:
                yield failure(d.finish_reason, d.error).body()
                return
            finish = _FINISH.get(d.finish_reason, "stop") if d.finish_reason else None
            text, calls = (d.text, ()) if tools is None else (tools.push(d.text), ())
            if tools is not None and finish:
                rest, calls = tools.finish(d.finish_reason)
                text, finish = text + rest, "tool_calls" if calls else finish
            if not text and not finish and not self.want_logprobs:
                continue  # a token with no visible text yet (held back, special or partial)
            choice: dict[str, Any] = {"index": 0}
            if self.chat:
                choice["delta"] = {"content": text} if text else {}
                if calls:
                    choice["delta"]["tool_calls"] = openai_tool_calls(calls, stream=True)
            else:
                choice["text"] = text
            lps = d.logprobs or ()
            choice["logprobs"] = self._logprobs(d.token_ids, lps, d.top_logprobs, offset)
            choice["finish_reason"] = finish
            yield {**self._head(obj), "choices": [choice], **extra}


def _chat_lp(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


async def collect(deltas: AsyncIterator[Delta]) -> Accumulator:
    acc = Accumulator()
    # aclosing: a cancelled (disconnected) request aborts its engine request right away.
    async with contextlib.aclosing(deltas) as it:  # type: ignore[type-var]
        async for d in it:
            acc.add(d)
    return acc


async def with_deadline(deltas: AsyncIterator[Delta], timeout_s: float) -> AsyncIterator[Delta]:
    """`deltas` until `timeout_s` after the request was queued, then one final "timeout" delta.
    Closing `deltas` (here, on timeout, or on a client disconnect) aborts the engine request."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with contextlib.aclosing(deltas) as it:  # type: ignore[type-var]
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    delta = await anext(it)
            except StopAsyncIteration:
                return
            except TimeoutError:
                why = f"request exceeded request_timeout_s={timeout_s:g} and was aborted"
                yield Delta("", (), None, None, FinishReason.TIMEOUT, 0, 0, why)
                return
            yield delta
            if delta.finish_reason is not None:
                return
