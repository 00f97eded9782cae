"""A real Prometheus scrapes the engine's metrics: (a) the standalone prometheus_client exporter,
(b) Ray's metrics export port, fed by RayMetricsSink inside a Ray actor running a tiny engine.

Assertions go through Prometheus' query API, so they check what a dashboard would see: series
present at 0 before any traffic, slot usage rising and returning to idle, TTFT counts, session
hits, and a forced graph-replay failure plus an eager fallback past the largest bucket.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from graph_helpers import FailOnce
from prom_server import PromServer, free_port, prometheus_binary
from ray_env import private_ray

from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.llm import build_engine
from shortconv.metrics.recorder import serve_metrics
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    prometheus_binary() is None,
    reason="the prometheus binary is not installed (Debian: apt-get install -y prometheus)",
)

HERE = Path(__file__).resolve().parent
TESTS, ROOT = HERE.parent, HERE.parent.parent
CONTEXT_BUCKET = 32  # the largest graph context: longer decode contexts run eagerly
PROMPTS = [[5, 9, 13], [7, 8], [1, 2, 3, 4]]
LONG_PROMPT = list(range(1, CONTEXT_BUCKET))  # its decode steps pass the largest bucket
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_lfm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=1)


def make_engine(path: str | Path) -> LLMEngine:
    cfg = EngineConfig(
        max_num_seqs=4,
        enable_graphs=True,
        graph_batch_sizes=(1, 2, 4),
        graph_context_sizes=(CONTEXT_BUCKET,),
        # The exporter's pipeline, with exact slot counts: sessions keep their own state here
        # (the prefix cache's series are checked through the service in test_serve_metrics).
        enable_prefix_caching=False,
    )
    return build_engine(path, dtype="float32", engine_config=cfg)


def run_all(engine: LLMEngine) -> dict[str, Any]:
    """Step until idle; returns the finished outputs by request id."""
    done = {}
    for _ in range(500):
        if not engine.has_unfinished():
            return done
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    raise AssertionError("the engine did not finish its requests")


def session_turns(engine: LLMEngine) -> int:
    """Two turns of one session; returns the second turn's resumed (cached) prompt tokens."""
    first = [11, 12, 13, 14]
    engine.add_request(first, GREEDY, session_id="s1")
    (out1,) = run_all(engine).values()
    engine.add_request(first + out1.token_ids + [21, 22], GREEDY, session_id="s1")
    (out2,) = run_all(engine).values()
    assert out2.num_cached_tokens > 0
    return out2.num_cached_tokens


def failure_traffic(engine: LLMEngine) -> None:
    """One forced replay failure, then decode steps past the largest context bucket."""
    FailOnce(engine.executor.runner.graphs, "after_replay")  # raises once, after the forward
    engine.add_request([3, 4, 5], GREEDY)
    run_all(engine)
    engine.add_request(LONG_PROMPT, GREEDY)
    run_all(engine)


def test_standalone_exporter_scraped_by_prometheus(tiny_lfm2: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_lfm2)
    server = serve_metrics(engine)
    used = 'shortconv_state_slots_used{pool="conv"}'
    try:
        with PromServer([f"127.0.0.1:{server.port}"], tmp_path / "prom") as prom:
            # Every series is there at 0 before the first request.
            prom.wait_value(used, lambda v: v == 0)
            for expr in (
                'shortconv_graph_replay_failures_total{reason="replay"}',
                'shortconv_graph_eager_fallbacks_total{reason="no_bucket"}',
                "shortconv_session_cache_hits_total",
                'shortconv_step_duration_seconds_count{phase="mixed"}',
            ):
                assert prom.value(expr) == 0, expr
            for p in PROMPTS:
                engine.add_request(p, GREEDY)
            seen: set[str] = set()
            while len(seen) < len(PROMPTS):  # every request holds its slot now
                seen.update(o.request_id for o in engine.step())
            prom.wait_value(used, lambda v: v == len(PROMPTS))
            prom.wait_value("shortconv_num_requests_running", lambda v: v == len(PROMPTS))
            run_all(engine)
            prom.wait_value(used, lambda v: v == 0)
            assert prom.value(f"max_over_time({used}[5m])") == len(PROMPTS)

            cached = session_turns(engine)
            failure_traffic(engine)
            n = len(PROMPTS) + 4
            # NOTE: wait on what moves last: a scrape taken while the long request still ran
            # already shows every first token, but not its finish.
            done = 'shortconv_request_success_total{finished_reason="length"}'
            prom.wait_value(done, lambda v: v == n)
            assert prom.value("shortconv_time_to_first_token_seconds_count") == n
            assert prom.value("shortconv_session_cache_hits_total") == 1
            assert prom.value("shortconv_prefix_cached_tokens_total") == cached
            assert prom.value("shortconv_sessions_held") == 1
            assert prom.value('shortconv_graph_replay_failures_total{reason="replay"}') == 1
            assert prom.value('shortconv_graph_eager_fallbacks_total{reason="replay_error"}') == 1
            assert prom.value('shortconv_graph_eager_fallbacks_total{reason="no_bucket"}') >= 1
            assert prom.value("shortconv_graph_replays_total") > 0
    finally:
        server.close()
        engine.shutdown()


# ---- (b) Ray's metrics export port ------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_metrics_port() -> Iterator[int]:
    pytest.importorskip("ray")
    port = free_port()
    # The actor class lives in this test module: workers import it (and prom_server,
    # graph_helpers from tests/) from here.
    env = {"PYTHONPATH": os.pathsep.join(map(str, (HERE, TESTS, ROOT)))}
    # NOTE: workers push metrics to the node's agent every interval; 1 s keeps the test short.
    system = {"metrics_report_interval_ms": 1000}
    with private_ray("scmx-", env, 2, _metrics_export_port=port, _system_config=system):
        yield port


class EngineActor:
    """A tiny engine reporting through RayMetricsSink, as an LLMServer replica will."""

    def __init__(self, path: str) -> None:
        from deployments.serve.metrics_sink import attach_ray_metrics

        self.engine = make_engine(path)
        assert attach_ray_metrics(self.engine) is not None

    def prompts(self) -> None:
        for p in PROMPTS:
            self.engine.add_request(p, GREEDY)
        run_all(self.engine)

    def sessions_and_failures(self) -> int:
        cached = session_turns(self.engine)
        failure_traffic(self.engine)
        return cached


def test_ray_metrics_port_scraped_by_prometheus(
    tiny_lfm2: Path, ray_metrics_port: int, tmp_path: Path
) -> None:
    import ray

    actor = ray.remote(num_cpus=0.5)(EngineActor).remote(str(tiny_lfm2))
    with PromServer([f"127.0.0.1:{ray_metrics_port}"], tmp_path / "prom") as prom:
        # Counters and gauges exist at 0 from the actor's start (histograms: first sample).
        prom.wait_value(
            'sum(ray_shortconv_graph_replay_failures_total{reason="replay"})',
            lambda v: v == 0,
            timeout_s=60,
        )
        for expr in (
            "ray_shortconv_session_cache_evictions_total",
            'ray_shortconv_state_slots_total{pool="conv"}',
            'ray_shortconv_request_success_total{finished_reason="abort"}',
        ):
            assert prom.value(f"sum({expr})") is not None, expr
        ray.get(actor.prompts.remote())
        cached = ray.get(actor.sessions_and_failures.remote())
        n = len(PROMPTS) + 4
        prom.wait_value("sum(ray_shortconv_time_to_first_token_seconds_count)", lambda v: v == n)
        prom.wait_value(
            'sum(ray_shortconv_graph_replay_failures_total{reason="replay"})', lambda v: v == 1
        )
        expect = {
            'ray_shortconv_graph_eager_fallbacks_total{reason="replay_error"}': 1,
            'ray_shortconv_request_success_total{finished_reason="length"}': n,
            "ray_shortconv_session_cache_hits_total": 1,
            "ray_shortconv_prefix_cached_tokens_total": cached,
            "ray_shortconv_sessions_held": 1,
            "ray_shortconv_num_requests_running": 0,
        }
        for expr, want in expect.items():
            prom.wait_value(f"sum({expr})", lambda v, w=want: v == w)
        assert prom.value('sum(ray_shortconv_graph_eager_fallbacks_total{reason="no_bucket"})') >= 1
        assert prom.value('sum(ray_shortconv_step_duration_seconds_count{phase="decode"})') > 0
    ray.kill(actor)
