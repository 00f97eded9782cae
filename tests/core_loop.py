"""Driving an engine (in-thread or a CoreEngine) through the replica's AsyncEngine loop."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.engine.engine_types import EngineDead
from shortconv.sampling.sampling_params import SamplingParams


def run_loop(engine: Any, body: Any) -> Any:
    """`asyncio.run(body(loop))` over an AsyncEngine started on `engine`, shut down after."""
    eng = AsyncEngine(engine, admission_limit=8)
    eng.start()
    try:
        return asyncio.run(body(eng))
    finally:
        eng.shutdown()


async def greedy_tokens(
    eng: AsyncEngine, rid: str, prompt: list[int], max_tokens: int
) -> list[int]:
    """The token ids of one greedy stream of `max_tokens` (no stop at EOS), failing on an error
    delta."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got: list[int] = []
    async for delta in eng.generate(prompt, params, rid):
        assert delta.error is None, delta.error
        got += delta.token_ids
    return got


async def kill_mid_stream(eng: AsyncEngine, pid: int, prompt: list[int]) -> tuple[Any, float]:
    """SIGKILL the core `pid` at a long stream's first delta; the stream's last delta and the
    seconds from the kill to the stream's end. The health check must fail by then."""
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    stream, last, killed_at = eng.generate(prompt, params, "k"), None, 0.0
    async for delta in stream:
        if not killed_at:
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
        last = delta
    elapsed = time.monotonic() - killed_at
    with pytest.raises(EngineDead, match="engine core"):
        await eng.check_health()
    return last, elapsed
