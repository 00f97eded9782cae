"""Disaggregated prefill: one side fills a request's state, the other imports it and decodes.

Prefill side (`prefill_state`): the prompt minus its last token runs under a transient session
with one greedy token, so the session keeps a checkpoint after `prompt[:-1]`; that state is
exported as a state bundle (shortconv/cache/state_bundle.py) and the session dropped, which
frees its slot and pages. The sampled token is thrown away: every token the client sees is
sampled on the decode side, with the request's own parameters and seed.

Decode side (`DecodeHandoff`): before a request starts, the bundle is fetched (over Ray's
object store: the prefill replica's return value) and imported under the request's session
(a transient one when it has none, dropped when the request ends). The request then resumes
from the checkpoint like any session turn: only the last prompt token is computed here. A
session this replica already holds is not handed off: its turn prefills only its new tokens
here. A bundle that is refused (checksum, fingerprint, layout, no room) or a prefill that
fails means the request prefills here in full: slower, never a wrong answer.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from deployments.frontend.openai.deltas import with_deadline
from shortconv.engine.outputs import FinishReason
from shortconv.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deployments.frontend.engine.async_engine import AsyncEngine
    from shortconv.engine.images import AnyImage

log = logging.getLogger(__name__)

_T = TypeVar("_T")
# NOTE: one greedy token: the least a request can generate; it is not used.
_PREFILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)
class PrefillCall:
    """What a decode replica asks a prefill replica to fill: the whole prompt (the prefill
    side computes all but its last token) and its images."""

    prompt: tuple[int, ...]
    images: tuple[AnyImage, ...] = ()


@dataclass(frozen=True)
class PrefillResult:
    """The bundle (None: nothing to hand over) and the prefill side's own times."""

    bundle: bytes | None
    prefill_s: float
    export_s: float


async def prefill_state(engine: AsyncEngine, call: PrefillCall, timeout_s: float) -> PrefillResult:
    """Fill `call.prompt[:-1]` on `engine` and export it (see the module docstring). Raises
    what `engine.generate` raises for a prompt it refuses."""
    sid = f"prefill-{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    deltas = engine.generate(list(call.prompt[:-1]), _PREFILL_PARAMS, sid, sid, call.images)
    try:
        finish = None
        async with aclosing(with_deadline(deltas, timeout_s)) as it:  # type: ignore[type-var]
            async for delta in it:
                finish = delta.finish_reason or finish
        t1 = time.perf_counter()
        ok = finish in (FinishReason.LENGTH, FinishReason.STOP)
        data = await engine.state_op("export", sid) if ok else None
        return PrefillResult(data, t1 - t0, time.perf_counter() - t1)
    finally:
        engine.drop_session(sid)


Fetch = Callable[[PrefillCall], Awaitable[PrefillResult]]


@dataclass
class HandoffCounters:
    """What this decode replica's handoffs did (its /v1/internal/stats `handoff`): requests
    by outcome, and over the imported ones the bundle bytes and the seconds of each part."""

    outcomes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("imported", "refused", "failed", "local"), 0)
    )
    bytes: int = 0
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("prefill", "export", "transfer", "import"), 0.0)
    )
    last: dict[str, float] = field(default_factory=dict)  # the latest imported handoff

    def imported(self, nbytes: int, parts: dict[str, float]) -> None:
        self.outcomes["imported"] += 1
        self.bytes += nbytes
        for k, v in parts.items():
            self.seconds[k] += v
        self.last = {"bytes": float(nbytes), **parts}

    def report(self) -> dict[str, Any]:
        n = max(1, self.outcomes["imported"])
        per = {"bytes": self.bytes / n, **{f"{k}_s": v / n for k, v in self.seconds.items()}}
        return {**self.outcomes, "bytes": self.bytes, "per_request": per, "last": self.last}


class DecodeHandoff:
    """The decode side of disaggregation over one AsyncEngine; `fetch` reaches a prefill
    replica (bound once, by LLMServer)."""

    def __init__(self, engine: AsyncEngine, fetch: Fetch) -> None:
        self.engine, self._fetch = engine, fetch
        self.counters = HandoffCounters()

    async def session_for(
        self, prompts: Sequence[list[int]], images: tuple[AnyImage, ...], session_id: str | None
    ) -> tuple[str | None, bool]:
        """The session to run the request under, and whether it is a transient one (to drop
        when the request ends). Only a single prompt of 2+ tokens is handed off."""
        held = session_id is not None and session_id in self.engine.stats().get("sessions", {})
        if len(prompts) != 1 or len(prompts[0]) < 2 or held:
            self.counters.outcomes["local"] += 1
            return session_id, False
        target = session_id or f"handoff-{uuid.uuid4().hex}"
        if not await self._take(prompts[0], images, target) and session_id is None:
            return None, False  # prefilled here in full, as without disaggregation
        return target, session_id is None

    async def _take(self, prompt: list[int], images: tuple[AnyImage, ...], sid: str) -> bool:
        t0 = time.perf_counter()
        try:
            got = await self._fetch(PrefillCall(tuple(prompt), images))
        except Exception:  # a prefill replica that failed or is gone: prefill here instead
            log.warning("prefill handoff failed; prefilling here", exc_info=True)
            got = None
        t1 = time.perf_counter()
        if got is None or got.bundle is None:
            self.counters.outcomes["failed"] += 1
            return False
        if not await self.engine.state_op("import", sid, got.bundle):
            self.counters.outcomes["refused"] += 1  # the engine counted it by reason
            return False
        hop = max(0.0, t1 - t0 - got.prefill_s - got.export_s)
        parts = {"prefill": got.prefill_s, "export": got.export_s, "transfer": hop}
        self.counters.imported(len(got.bundle), parts | {"import": time.perf_counter() - t1})
        return True

    def dropping(self, deltas: AsyncIterator[_T], session_id: str) -> AsyncIterator[_T]:
        """`deltas`, then the transient session dropped (its slot and pages freed), however
        the stream ends."""
        return _then_drop(self.engine, deltas, session_id)


async def _then_drop(engine: AsyncEngine, deltas: AsyncIterator[_T], sid: str) -> AsyncIterator[_T]:
    try:
        async with aclosing(deltas) as it:  # type: ignore[type-var]
            async for item in it:
                yield item
    finally:
        # NOTE: queued after the request's own abort (closing `deltas` queues that first).
        engine.drop_session(sid)
