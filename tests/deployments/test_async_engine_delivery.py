"""How AsyncEngine hands tokens to asyncio: one wake-up of the caller's event loop per engine
step (not one per stream), and a consumer that fell behind takes its backlog as one delta (one
message per hop downstream), with every token, logprob and the finish intact."""

from __future__ import annotations

import asyncio

from test_serve_api import OFFSET, FakeEngine

from deployments.frontend.engine import engine_commands
from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.engine.engine_types import Delta
from shortconv.sampling.sampling_params import SamplingParams

STREAMS, TOKENS = 4, 12


def params(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, **kw)


def test_one_wake_up_per_step_for_all_streams(monkeypatch) -> None:  # noqa: ANN001
    calls: list[int] = []
    real = engine_commands._put_now

    def counting(items: list) -> None:  # noqa: ANN001
        calls.append(len(items))
        real(items)

    monkeypatch.setattr(engine_commands, "_put_now", counting)

    async def main() -> list[list[Delta]]:
        eng = AsyncEngine(FakeEngine(), admission_limit=STREAMS)
        eng.start()
        gens = [eng.generate([1, 2], params(), f"r{i}") for i in range(STREAMS)]

        async def drain(gen) -> list[Delta]:  # noqa: ANN001
            return [d async for d in gen]

        tasks = [asyncio.create_task(drain(g)) for g in gens]
        try:
            return await asyncio.gather(*tasks)
        finally:
            eng.shutdown()

    got = asyncio.run(main())
    assert all(sum(len(d.token_ids) for d in deltas) == TOKENS for deltas in got)
    assert calls and max(calls) == STREAMS  # one call carried every stream's delta
    # NOTE: the requests may join over a step or two; from then on one call per step.
    assert sum(calls) == STREAMS * TOKENS and len(calls) <= TOKENS + STREAMS


def test_a_consumer_behind_gets_its_backlog_as_one_delta() -> None:
    async def main() -> list[Delta]:
        eng = AsyncEngine(FakeEngine(), admission_limit=2)
        eng.start()
        try:
            gen = eng.generate([1, 2], params(logprobs=1), "slow")
            first = await gen.__anext__()
            await asyncio.sleep(0.3)  # the engine finishes the request meanwhile
            return [first] + [d async for d in gen]
        finally:
            eng.shutdown()

    deltas = asyncio.run(main())
    assert len(deltas) < TOKENS  # merged, not one per token
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == [OFFSET + ord("a") + i % 26 for i in range(TOKENS)]
    assert "".join(d.text for d in deltas) == "abcdefghijkl"
    assert sum(len(d.logprobs or ()) for d in deltas) == TOKENS
    assert sum(len(d.top_logprobs or ()) for d in deltas) == TOKENS
    assert deltas[-1].finish_reason == "length" and all(
        d.finish_reason is None for d in deltas[:-1]
    )


def test_then_joins_two_deltas() -> None:
    a = Delta("x", (1,), None, None, None, 5, 0)
    b = Delta("y", (2,), None, None, "stop", 5, 2)
    assert a.then(b) == Delta("xy", (1, 2), None, None, "stop", 5, 2)
