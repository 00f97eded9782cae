"""The engine core process without Ray: the replica's AsyncEngine over a CoreEngine gives the
in-thread engine's greedy tokens, refuses bad requests before they cross, relays the core's
metrics, and ends every stream with an error at once when the core is killed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from core_loop import greedy_tokens, kill_mid_stream, run_loop
from prometheus_client import generate_latest

from deployments.frontend.config.args import AppArgs
from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.engine.core_client import CoreEngine
from deployments.frontend.engine.engine_build import build_engine
from shortconv.metrics.recorder import PrometheusClientSink
from shortconv.sampling.sampling_params import InvalidRequest, SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

PROMPT = [5, 6, 7, 8, 9]
ERROR_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def args(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ckpt = make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=3)
    return {"model": str(ckpt), "dtype": "float32", "max_num_seqs": 4}


@pytest.fixture()
def core(args: dict[str, Any]) -> Iterator[CoreEngine]:
    engine = CoreEngine.spawn(args, None, 1)
    yield engine
    engine.shutdown()


async def tokens(eng: AsyncEngine, rid: str, max_tokens: int = 12) -> list[int]:
    return await greedy_tokens(eng, rid, PROMPT, max_tokens)


def test_core_gives_the_in_thread_engines_tokens(args: dict[str, Any], core: CoreEngine) -> None:
    async def two(eng: AsyncEngine) -> list[list[int]]:
        return list(await asyncio.gather(tokens(eng, "a"), tokens(eng, "b", 20)))

    want = run_loop(build_engine(AppArgs.model_validate(args)), two)
    assert run_loop(core, two) == want
    assert core.stats().num_running == 0 and core.core_report.who == "core"
    assert [name for name, _ in core.core_report.phases][-1] == "engine"


def test_bad_requests_are_refused_in_the_replica(core: CoreEngine) -> None:
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        core.validate([10**9], SamplingParams())
    with pytest.raises(InvalidRequest, match="maximum model length"):
        core.validate([5] * core.max_model_len, SamplingParams())


def test_the_cores_metrics_reach_the_replicas_sink(core: CoreEngine) -> None:
    sink = PrometheusClientSink()
    core.relay_metrics_to(sink)
    run_loop(core, lambda eng: tokens(eng, "m"))
    text = generate_latest(sink.registry).decode()
    assert "shortconv_generation_tokens_total 12.0" in text, text


def test_a_killed_core_ends_streams_with_an_error_and_fails_health(core: CoreEngine) -> None:
    last, elapsed = run_loop(core, lambda eng: kill_mid_stream(eng, core.pid, PROMPT))
    assert last.finish_reason == "error" and "engine core" in last.error
    assert elapsed < ERROR_WITHIN_S
