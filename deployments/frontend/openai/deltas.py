"""One request's engine deltas on the OpenAI side: folded into totals, merged across the
engine requests of one HTTP request (a completions batch: one per prompt), numbered by choice
(`n` forks per prompt), and cut off at the request deadline. Closing any of these streams aborts
the engine requests behind it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from deployments.frontend.engine.engine_types import Delta
from shortconv.engine.outputs import FinishReason


@dataclass
class Accumulator:
    """Folds one choice's deltas into the totals a response needs."""

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
        return usage_of([self])


def usage_of(accs: Sequence[Accumulator]) -> dict[str, Any]:
    """OpenAI's usage over every choice: tokens summed, each prompt counted once (as vLLM
    counts a batch of prompts; the forks of a prompt past the first carry none, `by_choice`)."""
    prompt = sum(a.num_prompt_tokens for a in accs)
    completion = sum(len(a.token_ids) for a in accs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(a.num_cached_tokens for a in accs)},
    }


async def collect(deltas: AsyncIterator[tuple[int, Delta]], accs: Sequence[Accumulator]) -> None:
    """Fold indexed deltas into `accs` until every stream has ended."""
    # aclosing: a cancelled (disconnected) request aborts its engine requests right away.
    async with contextlib.aclosing(deltas) as it:  # type: ignore[type-var]
        async for i, d in it:
            accs[i].add(d)


_DONE = object()


async def merge(streams: Sequence[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """(stream index, delta) from every stream as they come. Closing the merge (or one stream
    failing) closes every stream, so no engine request outlives its HTTP request."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for d in only:
                yield 0, d
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async with contextlib.aclosing(stream) as it:  # type: ignore[type-var]
                async for d in it:
                    queue.put_nowait((i, d))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((i, exc))
        queue.put_nowait((i, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is _DONE:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def by_choice(
    deltas: AsyncIterator[tuple[int, Delta]], n: int
) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from (prompt index, delta): fork j of prompt i is choice i*n + j,
    vLLM's order. A fork past the first reports no prompt or cached tokens: the prompt was
    computed once, and OpenAI's usage counts it once."""
    async with contextlib.aclosing(deltas) as it:  # type: ignore[type-var]
        async for i, d in it:
            if d.index:
                d = replace(d, num_prompt_tokens=0, num_cached_tokens=0)
            yield i * n + d.index, d


async def with_deadline(deltas: AsyncIterator[Delta], timeout_s: float) -> AsyncIterator[Delta]:
    """`deltas` until `timeout_s` after the request was queued, then one final "timeout" delta.
    Closing `deltas` (here, on timeout, or on a client disconnect) aborts the engine request.
    NOTE: runs until `deltas` ends, not at the first finish: a request's forks finish apart."""
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
