"""Disaggregated prefill without Ray: a decode OpenAIReplica takes each prompt's state from a
prefill OpenAIReplica (its `prefill` call as the fetch) and must answer exactly as a plain
replica over a third engine on the same checkpoint: greedy tokens and per-token logprobs.
Refused bundles and failed prefills fall back to a full prefill here with the same answer,
and nothing is left held on either side. The Serve layout is tested through `serve run` in
test_serve_disagg.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from bundle_damage import shifted

from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.openai.api import ApiConfig, OpenAIReplica
from deployments.frontend.openai.handoff import DecodeHandoff, PrefillCall, PrefillResult
from deployments.frontend.openai.protocol import CompletionRequest
from deployments.frontend.openai.replica import RequestContext
from shortconv.configs.config import EngineConfig
from shortconv.llm import build_engine
from shortconv.tiny.checkpoint import make_tiny_checkpoint

P1 = [int(t) for t in torch.randint(4, 500, (23,), generator=torch.Generator().manual_seed(7))]
Transform = Callable[[PrefillResult], PrefillResult]


SEEDS = {"lfm2": 11, "zaya1": 5, "lfm3": 11, "lfm2_moe": 11}  # outputs that vary with the state


@pytest.fixture(scope="module", params=sorted(SEEDS))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    seed = SEEDS[request.param]
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=seed)


def replica(ckpt: Any, handoff_from: OpenAIReplica | None = None, t: Transform | None = None):
    cfg = EngineConfig(enable_prefix_caching=False, kv_page_size=4)
    eng = AsyncEngine(build_engine(ckpt, dtype="float32", engine_config=cfg), admission_limit=8)
    eng.start()
    handoff = None
    if handoff_from is not None:
        handoff = DecodeHandoff(eng, _fetch(handoff_from, t or (lambda r: r)))
    return OpenAIReplica(eng, ApiConfig("tiny", "r"), None, handoff)


def _fetch(prefill: OpenAIReplica, t: Transform) -> Callable[[PrefillCall], Awaitable[Any]]:
    async def fetch(call: PrefillCall) -> PrefillResult:
        return t(await prefill.prefill(call))

    return fetch


async def complete(r: OpenAIReplica, prompt: list[int], sid: str | None = None) -> dict:
    req = CompletionRequest(prompt=prompt, max_tokens=6, temperature=0.0, logprobs=0)
    req.ignore_eos = True
    body = (await r.completion(req, RequestContext(sid))).body
    choice = body["choices"][0]
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return {"text": choice["text"], "lps": choice["logprobs"]["token_logprobs"], "cached": cached}


def same(a: dict, b: dict) -> bool:
    close = all(abs(x - y) < 1e-4 for x, y in zip(a["lps"], b["lps"], strict=True))
    return a["text"] == b["text"] and close


async def settled(r: OpenAIReplica) -> list[str]:
    """The sessions the engine holds once every queued command ran (an op on a session
    nobody holds is a barrier: commands run in order)."""
    await r.engine.state_op("drop", "barrier")
    return r.engine.engine.sessions.session_ids()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_handed_off_equals_plain_and_leaves_nothing_held(ckpt: Any) -> None:
    async def main() -> None:
        pre = replica(ckpt)
        dec, plain = replica(ckpt, pre), replica(ckpt)
        slots = pre.engine.engine.scheduler.cache_manager.slots.num_free
        got, want = await complete(dec, P1), await complete(plain, P1)
        assert same(got, want), (got, want)
        assert got["cached"] == len(P1) - 1  # only the last prompt token was computed here
        assert dec.handoff is not None and dec.handoff.counters.outcomes["imported"] == 1
        assert dec.handoff.counters.bytes > 0
        assert await settled(dec) == [] and await settled(pre) == []
        assert pre.engine.engine.scheduler.cache_manager.slots.num_free == slots

    run(main())


def test_a_session_stays_on_its_decode_replica(ckpt: Any) -> None:
    async def main() -> None:
        pre = replica(ckpt)
        dec, plain = replica(ckpt, pre), replica(ckpt)
        one = await complete(dec, P1, "s")
        assert same(one, await complete(plain, P1, "s"))
        p2 = [*P1, 40, 41, 42]  # turn 1's prompt end, then a short suffix
        two, want = await complete(dec, p2, "s"), await complete(plain, p2)
        assert same(two, want), (two, want)
        assert two["cached"] == len(P1)  # resumed here, from the handed-off prompt end
        assert dec.handoff is not None
        assert dec.handoff.counters.outcomes == {
            "imported": 1,
            "refused": 0,
            "failed": 0,
            "local": 1,
        }
        assert await settled(dec) == ["s"]

    run(main())


def _flipped(r: PrefillResult) -> PrefillResult:
    assert r.bundle is not None
    data = bytearray(r.bundle)
    data[len(data) // 2] ^= 0x10
    return PrefillResult(bytes(data), r.prefill_s, r.export_s)


def _broken(r: PrefillResult) -> PrefillResult:
    raise RuntimeError("the prefill replica is gone")


@pytest.mark.parametrize("damage", ["refused", "failed"])
def test_refused_or_failed_handoff_prefills_here(ckpt: Any, damage: str) -> None:
    async def main() -> None:
        pre = replica(ckpt)
        dec = replica(ckpt, pre, _flipped if damage == "refused" else _broken)
        plain = replica(ckpt)
        got, want = await complete(dec, P1), await complete(plain, P1)
        assert same(got, want) and got["cached"] == 0
        assert dec.handoff is not None and dec.handoff.counters.outcomes[damage] == 1
        refused = dec.engine.engine.session_state.counters.refused
        assert dict(refused) == ({"checksum": 1} if damage == "refused" else {})
        assert await settled(dec) == [] and await settled(pre) == []

    run(main())


def test_oracle_bites_on_a_window_shifted_by_one_token(ckpt: Any) -> None:
    def shift(r: PrefillResult) -> PrefillResult:
        assert r.bundle is not None
        return PrefillResult(shifted(r.bundle), r.prefill_s, r.export_s)

    async def main() -> None:
        pre = replica(ckpt)
        dec, plain = replica(ckpt, pre, shift), replica(ckpt)
        got, want = await complete(dec, P1), await complete(plain, P1)
        assert got["cached"] == len(P1) - 1  # imported: only the oracle can tell
        assert not same(got, want)

    run(main())


def test_a_stream_equals_plain_and_a_stream_left_early_leaves_nothing(ckpt: Any) -> None:
    async def text_of(r: OpenAIReplica, stop_after: int | None = None) -> str:
        req = CompletionRequest(prompt=P1, max_tokens=6, temperature=0.0, stream=True)
        req.ignore_eos = True
        texts: list[str] = []
        stream = r.completion_stream(req, RequestContext())
        async for reply in stream:
            texts += [c.get("text", "") for c in reply.body.get("choices", ())]
            if stop_after is not None and len(texts) >= stop_after:
                break  # the client left: the stream is closed mid-way
        await stream.aclose()  # type: ignore[attr-defined]
        return "".join(texts)

    async def main() -> None:
        pre = replica(ckpt)
        dec, plain = replica(ckpt, pre), replica(ckpt)
        slots = dec.engine.engine.scheduler.cache_manager.slots.num_free
        assert await text_of(dec) == await text_of(plain)
        await text_of(dec, stop_after=1)
        assert dec.handoff is not None and dec.handoff.counters.outcomes["imported"] == 2
        # NOTE: a stream left early is closed by its generator's finalizer, a task the event
        # loop runs soon after: its abort, then the transient session's drop.
        for _ in range(600):
            if not dec.engine.num_admitted and not await settled(dec):
                break
            await asyncio.sleep(0.05)
        assert await settled(dec) == [] and await settled(pre) == []
        assert dec.engine.engine.scheduler.cache_manager.slots.num_free == slots

    run(main())
