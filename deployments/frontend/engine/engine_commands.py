"""What callers ask of AsyncEngine's loop thread: small frozen commands, dispatched by type."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deployments.frontend.engine.state_ops import StateOp
from shortconv.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deployments.frontend.engine.engine_types import Delta
    from shortconv.engine.images import AnyImage
    from shortconv.sampling.grammar.spec import GrammarSpec


@dataclass(frozen=True)
class Stream:
    """Where one request's deltas go: a queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Delta]
    session_id: str | None


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: Stream
    images: tuple[AnyImage, ...] = ()  # the prompt's images, in order (engine/images.py)
    lora_name: str | None = None  # the request's LoRA adapter (None: the base model)


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class CheckHealth:
    """Answered with the reason the engine or its executor is unusable, or None."""

    reply: asyncio.Future[str | None]


@dataclass(frozen=True)
class ResetPrefixCache:
    """Answered with the number of prefix-cache entries dropped."""

    reply: asyncio.Future[int]


@dataclass(frozen=True)
class UpdateLora:
    """`op` "load" (`name` from `path`) or "unload" (`name`); answered with the refusal's
    message, or None."""

    op: str
    name: str
    path: str
    reply: asyncio.Future[str | None]


@dataclass(frozen=True)
class CompileGrammar:
    """An engine in a core process compiles `spec` there; answered with why it failed, or
    None."""

    spec: GrammarSpec
    reply: asyncio.Future[str | None]


@dataclass(frozen=True)
class Stop:
    pass


Command = (
    AddRequest
    | Abort
    | CheckHealth
    | ResetPrefixCache
    | UpdateLora
    | CompileGrammar
    | StateOp
    | Stop
)


def answer(fut: asyncio.Future[Any], value: Any) -> None:
    """Resolve `fut` from the loop thread (on its own event loop)."""
    fut.get_loop().call_soon_threadsafe(_resolve, fut, value)


def _resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def put(stream: Stream, delta: Delta) -> None:
    """Queue `delta` on its stream from the loop thread."""
    put_all(stream.loop, [(stream, delta)])


def put_all(loop: asyncio.AbstractEventLoop, items: list[tuple[Stream, Delta]]) -> None:
    """Queue each delta on its stream, all in one callback on `loop`: one wake-up per step."""
    with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody listens
        loop.call_soon_threadsafe(_put_now, items)


def _put_now(items: list[tuple[Stream, Delta]]) -> None:
    for stream, delta in items:
        stream.queue.put_nowait(delta)
