"""Shared by tests/deployments/test_reliability_*.py and test_serve_metrics.py:
a private Ray + Serve instance on loopback ports, SSE
parsing, per-replica stats, and the fault-injecting engine factories the fault tests deploy.

A factory is imported inside the replica as `tests.reliability_helpers:faulty_engine` (Ray puts
the driver's working directory, the repository root, on the workers' path), so this module
imports nothing from the test modules and nothing heavy at import time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPLICA_HEADER = "x-shortconv-replica"
SESSION_HEADER = "x-session-id"
IDLE_KEYS = ("num_running", "num_waiting", "num_active_requests", "slots_used", "kv_pages_used")

# Fault-injection knobs, recognised by faulty_engine through the request's seed.
POISON_SEED = 666_001  # this request's third token raises inside the engine (one request fails)
SLOW_SEED = 666_002  # while this request runs, every engine step sleeps SLOW_STEP_S
SLOW_STEP_S = 0.4  # 120 steps outlast test_reliability_faults' request_timeout_s
FAULT_LOG_ENV = "SCSV_FAULT_LOG"  # file the factory appends one line to per preemption
FAULT_KV_PAGES_ENV = "SCSV_FAULT_KV_PAGES"
FAULT_KV_PAGE_SIZE = 8
REPLAY_FAILURES = 1  # decode-graph replays replay_failing_engine makes fail


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, period_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@contextmanager
def serve_app(
    tmp: Path,
    args: dict[str, Any],
    env: dict[str, str] | None = None,
    num_cpus: int = 4,
    runtime_env: dict[str, Any] | None = None,
    **overrides: Any,
) -> Iterator[str]:
    """Run `deployments.serve.app` with `args` on a private Ray runtime (the job's
    `runtime_env` besides `env`, the replicas' too); yields the base URL."""
    from ray import serve
    from ray_env import free_port, model_cache, private_ray  # not at module level: replicas

    from deployments.serve.app import build_app, parse_args

    env_vars = {"XDG_CACHE_HOME": str(model_cache(tmp.parent)), **(env or {})}
    with private_ray("scrl-", env_vars, num_cpus=num_cpus, runtime_env=runtime_env):
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            engine_factory = overrides.pop("engine_factory", None)
            app = build_app(parse_args(args), engine_factory, **overrides)
            serve.run(app, name="rel", route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()


CORE = "deployments.frontend.engine.engine_core"  # the core's command line: python -m CORE
CORE_KILL_OVERRIDES = {"num_replicas": 1, "health_check_period_s": 1, "health_check_timeout_s": 20}


def short_completion(base: str) -> httpx.Response | None:
    """A 6-token greedy completion of "hello", or None when it failed (a replica going)."""
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0.0}
    try:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    except httpx.HTTPError:
        return None
    return r if r.status_code == 200 else None


def stream_and_kill(
    http: httpx.Client, body: dict[str, Any], kill: Callable[[], None], after: int = 3
) -> tuple[list[str], float]:
    """Stream a completion, calling `kill()` once `after` events came; returns every `data:`
    payload and the seconds from the kill to the stream's end."""
    events: list[str] = []
    killed_at: float | None = None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            events += [line[6:]] if line.startswith("data: ") else []
            # NOTE: once: the blank line after an event leaves the count where it was.
            if len(events) == after and killed_at is None:
                kill()
                killed_at = time.monotonic()
    assert killed_at is not None, f"the stream ended after {len(events)} events"
    return events, time.monotonic() - killed_at


def sse_data(text: str) -> list[str]:
    """The `data:` payloads of a server-sent-events body, in order."""
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def stream_text(events: list[str]) -> str:
    """Concatenated text of completion or chat chunks (errors and [DONE] skipped)."""
    out = []
    for e in events:
        if e == "[DONE]":
            continue
        for c in json.loads(e).get("choices", []):
            out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


def replica_stats(http: httpx.Client, num_replicas: int, within_s: float = 30.0) -> dict[str, dict]:
    """/v1/internal/stats of every replica (requests without a session spread over them).

    NOTE: asked until each replica answered or `within_s` passed, with a pause between asks:
    right after a load, the router sends every ask to the replica it sees least loaded while
    the other drains, and a fixed number of back-to-back asks (40) all reached one replica
    under a full parallel test run."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + within_s
    while True:
        r = http.get("/v1/internal/stats")
        seen[r.headers[REPLICA_HEADER]] = r.json()
        if len(seen) >= num_replicas or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


def idle(stats: dict[str, Any]) -> bool:
    """Nothing running, queued or held by a session, and no slot or KV page in use but the
    prefix cache's (evictable at any time; `flush_prefix_caches` gives those back too)."""
    held = {
        **stats,
        "slots_used": stats["slots_used"] - stats["prefix_cache_checkpoints"],
        "kv_pages_used": stats["kv_pages_used"] - stats["prefix_cache_pages"],
    }
    return all(held[k] == 0 for k in IDLE_KEYS) and stats["sessions_held"] == 0


def flush_prefix_caches(http: httpx.Client, num_replicas: int, tries: int = 40) -> None:
    """POST /v1/internal/reset_prefix_cache until every replica has answered one."""
    flushed: set[str] = set()
    for _ in range(tries):
        r = http.post("/v1/internal/reset_prefix_cache")
        r.raise_for_status()
        flushed.add(r.json()["replica_id"])
        if len(flushed) >= num_replicas:
            return
    raise AssertionError(f"reached {len(flushed)} of {num_replicas} replicas to flush")


def wait_idle(http: httpx.Client, num_replicas: int, timeout_s: float = 30.0) -> dict[str, dict]:
    def check() -> dict[str, dict] | None:
        seen = replica_stats(http, num_replicas)
        ok = len(seen) == num_replicas and all(idle(s) for s in seen.values())
        return seen if ok else None

    return wait_for(check, timeout_s, "every replica to return to idle", period_s=0.5)


# ---- the fault-injecting engine (runs inside the replica) -----------------------------------
def faulty_engine(args: Any) -> Any:
    """The real engine with test-only faults keyed on the request's seed, a small KV pool (so
    decode growth preempts), and every preemption logged to $SCSV_FAULT_LOG."""
    from deployments.frontend.config.model_source import resolve_model
    from shortconv.llm import build_engine

    cfg = dataclasses.replace(
        args.engine_config(),
        kv_page_size=FAULT_KV_PAGE_SIZE,
        num_kv_pages=int(os.environ.get(FAULT_KV_PAGES_ENV, "0")),
    )
    engine = build_engine(resolve_model(args), dtype=args.dtype, seed=args.seed, engine_config=cfg)
    emit, step, preempt = engine._emit, engine.step, engine.scheduler._preempt
    log_path = os.environ.get(FAULT_LOG_ENV)

    def faulty_emit(req: Any) -> Any:
        if req.params.seed == POISON_SEED and len(req.output_token_ids) >= 3:
            raise RuntimeError("injected fault in one request")
        return emit(req)

    def slow_step() -> Any:
        if any(r.params.seed == SLOW_SEED for r in engine.scheduler.running):
            time.sleep(SLOW_STEP_S)
        return step()

    def logged_preempt(req: Any) -> None:
        if log_path:
            with open(log_path, "a") as f:
                f.write(f"{req.request_id}\n")
        preempt(req)

    engine._emit, engine.step = faulty_emit, slow_step  # type: ignore[method-assign]
    engine.scheduler._preempt = logged_preempt  # type: ignore[method-assign]
    return engine


def replay_failing_engine(args: Any) -> Any:
    """The real engine (the deployment's default factory) whose in-process graph runner fails
    its first REPLAY_FAILURES replays after the forward ran (injected from test code:
    `graph_helpers.FailOnce`), so a replay failure is observed end to end: the step's state
    restored, the step recomputed eagerly, both counted."""
    from deployments.serve.server import build_engine
    from tests.graph_helpers import FailOnce

    engine = build_engine(args)
    graphs = engine.executor.runner.graphs
    if graphs is None:
        raise ValueError("replay_failing_engine needs tp_size=1 and enable_graphs")
    FailOnce(graphs, "after_replay", times=REPLAY_FAILURES)
    return engine
