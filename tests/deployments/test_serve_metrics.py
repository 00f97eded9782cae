"""The metrics acceptance test: the real service, scraped by a real Prometheus.

One LLMServer replica (tiny LFM2, decode graphs on with batch buckets [1, 2], one forced replay
failure injected by the test's engine factory, `reliability_helpers.replay_failing_engine`)
runs under `serve.run` on a private Ray runtime whose metrics export port a loopback
Prometheus scrapes every second. Traffic: one plain request (its first decode replay is the
forced failure), three 3-turn sessions, a burst of concurrent requests (more decode rows than
the largest bucket: eager no_bucket steps), one more plain request. Everything is asserted
through Prometheus' query API, as a dashboard sees it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prom_server import PromServer, free_port, prometheus_binary
from ray_env import model_cache, private_ray
from reliability_helpers import REPLAY_FAILURES, replay_failing_engine

from deployments.serve.app import build_app, deployment_options, parse_args
from deployments.serve.server import build_engine
from shortconv.sampling.sampling_params import SamplingParams

APP = "scm"
MODEL = "tiny-lfm2"
SESSION_TTL_S = 4.0  # kept sessions hold slots this long; the test waits for their eviction
SESSIONS, TURNS, BURST = 3, 3, 6
SEL = f'deployment="LLMServer",application="{APP}"'

needs_prometheus = pytest.mark.skipif(
    prometheus_binary() is None,
    reason="the prometheus binary is not installed (Debian: apt-get install -y prometheus)",
)


@dataclass
class Stack:
    prom: PromServer
    http: httpx.Client


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    pytest.importorskip("ray")
    from ray import serve

    cache = model_cache(tmp_path_factory.getbasetemp())
    metrics_port, http_port = free_port(), free_port()
    env = {"XDG_CACHE_HOME": str(cache)}
    # NOTE: workers push metrics to the node's agent every interval; 1 s keeps the test short.
    system = {"metrics_report_interval_ms": 1000}
    with private_ray("scsm-", env, 2, _metrics_export_port=metrics_port, _system_config=system):
        prom = PromServer([f"127.0.0.1:{metrics_port}"], tmp_path_factory.mktemp("prom"))
        try:
            prom.start()  # before the replica: its start-up zeros are scraped too
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
            args = parse_args(
                {
                    "tiny_arch": "lfm2",
                    "max_num_seqs": 8,
                    "num_state_slots": 32,
                    "enable_graphs": True,
                    "graph_batch_sizes": [1, 2],
                    "session_ttl_s": SESSION_TTL_S,
                }
            )
            actor = deployment_options(args)["ray_actor_options"]
            factory = "tests.reliability_helpers:replay_failing_engine"
            app = build_app(args, factory, num_replicas=1, ray_actor_options=actor)
            serve.run(app, name=APP)
            with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as http:
                yield Stack(prom, http)
        finally:
            prom.stop()
            serve.shutdown()


def complete(http: httpx.Client, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    r = http.post("/v1/completions", json={**body, "ignore_eos": True})
    r.raise_for_status()
    return r.json()


def session(http: httpx.Client, sid: str) -> list[int]:
    """TURNS chat turns of one session, back to back; returns each turn's cached tokens."""
    messages: list[dict[str, str]] = []
    cached = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"{sid}, turn {turn}: tell me more."})
        body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0.0}
        r = http.post("/v1/chat/completions", json=body, headers={"x-session-id": sid})
        r.raise_for_status()
        out = r.json()
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        details = out["usage"].get("prompt_tokens_details") or {}
        cached.append(details.get("cached_tokens") or 0)
    return cached


def select(expr: str) -> str:
    """`expr` (a name with optional labels) narrowed to this app's replica."""
    name, _, labels = expr.partition("{")
    return f"{name}{{{SEL}{',' + labels.rstrip('}') if labels else ''}}}"


def total(expr: str) -> str:
    """`expr` summed over Ray's per-process series of this app's replica."""
    return f"sum({select(expr)})"


def peak(expr: str) -> str:
    """The highest scraped sample of `expr` in the last 5 minutes.
    NOTE: over the raw samples; a `[5m:1s]` subquery can miss the newest one."""
    return f"max(max_over_time({select(expr)}[5m]))"


@needs_prometheus
def test_service_metrics_reach_prometheus(stack: Stack) -> None:
    prom, http = stack.prom, stack.http
    used = 'ray_shortconv_state_slots_used{pool="conv"}'
    # Every counter and gauge exists from the replica's start, before any request.
    prom.wait_value(
        total('ray_shortconv_graph_replay_failures_total{reason="replay"}'),
        lambda v: v == 0,
        timeout_s=60,
    )
    idle = prom.wait_value(total(used), lambda v: v >= 0)
    for expr in (
        'ray_shortconv_graph_eager_fallbacks_total{reason="no_bucket"}',
        "ray_shortconv_session_cache_hits_total",
        "ray_shortconv_sessions_held",
        'ray_shortconv_request_success_total{finished_reason="abort"}',
    ):
        assert prom.value(total(expr)) == 0, expr
    (series,) = prom.query(select("ray_shortconv_graph_replays_total"))
    assert series["metric"]["deployment"] == "LLMServer" and series["metric"]["replica"]

    # The first decode replay is the forced failure: restored, recomputed eagerly, counted.
    first = complete(http, "The quick brown fox")
    assert first["choices"][0]["finish_reason"] == "length"
    with ThreadPoolExecutor(SESSIONS) as pool:
        cached = list(pool.map(lambda i: session(http, f"metrics-{i}"), range(SESSIONS)))
    assert all(c[0] == 0 for c in cached) and all(n > 0 for c in cached for n in c[1:]), cached
    hits = sum(n > 0 for c in cached for n in c)
    start = threading.Barrier(BURST)  # released together: one batch of BURST decode rows

    def burst(i: int) -> dict[str, Any]:
        # Long enough that rows arriving apart on a loaded machine still overlap in decode
        # (at 12 tokens the full suite once saw no step above the largest bucket).
        start.wait()
        return complete(http, f"burst {i} counts up:", max_tokens=64)

    with ThreadPoolExecutor(BURST) as pool:
        outs = list(pool.map(burst, range(BURST)))
    assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)
    complete(http, "One more plain request")
    requests = 1 + SESSIONS * TURNS + BURST + 1

    prom.wait_value(
        total("ray_shortconv_time_to_first_token_seconds_count"), lambda v: v == requests
    )
    expect = {
        'ray_shortconv_graph_replay_failures_total{reason="replay"}': 1,
        'ray_shortconv_graph_replay_failures_total{reason="prepare"}': 0,
        'ray_shortconv_graph_eager_fallbacks_total{reason="replay_error"}': 1,
        "ray_shortconv_session_cache_hits_total": hits,
        "ray_shortconv_num_requests_running": 0,
    }
    for expr, want in expect.items():
        prom.wait_value(total(expr), lambda v, w=want: v == w)
    assert prom.value(total('ray_shortconv_graph_eager_fallbacks_total{reason="no_bucket"}')) > 0
    assert prom.value(total("ray_shortconv_graph_replays_total")) > 0
    assert prom.value(total("ray_shortconv_e2e_request_latency_seconds_count")) == requests

    # Slots rose with the traffic (running requests, then kept sessions) ...
    assert prom.value(peak(used)) > idle
    assert prom.value(peak("ray_shortconv_sessions_held")) == SESSIONS
    # ... and return to the idle value once the TTL drops the kept sessions. No step runs then:
    # only the idle loop's sweep and gauge refresh can bring these back.
    prom.wait_value(total("ray_shortconv_session_cache_evictions_total"), lambda v: v == SESSIONS)
    prom.wait_value(total("ray_shortconv_sessions_held"), lambda v: v == 0)
    # The prefix cache looked every prompt up and kept checkpoints (the sessions' turns hit it);
    # its slots are what is left in use, and a flush gives them back.
    assert prom.value(total("ray_shortconv_prefix_cache_hits_total")) > 0
    assert prom.value(total("ray_shortconv_prefix_cache_queries_total")) > 0
    checkpoints = prom.value(total("ray_shortconv_prefix_cache_checkpoints"))
    assert checkpoints > 0 and prom.value(total(used)) == idle + checkpoints
    assert http.post("/v1/internal/reset_prefix_cache").json()["dropped"] > 0
    prom.wait_value(total(used), lambda v: v == idle)
    prom.wait_value(total("ray_shortconv_prefix_cache_checkpoints"), lambda v: v == 0)


def test_build_engine_passes_graph_args_session_ttl_and_the_test_factory_fails_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app's graph args reach the engine; the test's factory wraps that same engine (the
    production build carries no fault hook) and its first replay fails, then replays work."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    base = {"tiny_arch": "lfm2", "max_num_seqs": 4, "dtype": "float32"}
    args = {**base, "enable_graphs": True, "graph_batch_sizes": [1, 2], "session_ttl_s": 7.0}
    engine = replay_failing_engine(parse_args(args))
    try:
        graphs = engine.executor.runner.graphs  # type: ignore[attr-defined]
        assert graphs.batch_sizes == (1, 2)  # CPU default is off: on here
        assert engine.sessions.ttl_s == 7.0  # from the args, at construction
        engine.add_request(
            [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2 + REPLAY_FAILURES)
        )
        while engine.has_unfinished():
            engine.step()
        stats = graphs.stats()
        assert stats.replay_failures["replay"] == REPLAY_FAILURES
        assert stats.eager_fallbacks["replay_error"] == REPLAY_FAILURES and stats.replays == 1
    finally:
        engine.shutdown()
    for off in ({"enable_graphs": False}, {}):  # explicit off, and the CPU default
        engine = build_engine(parse_args({**base, **off}))
        try:
            assert engine.executor.runner.graphs is None  # type: ignore[attr-defined]
        finally:
            engine.shutdown()
