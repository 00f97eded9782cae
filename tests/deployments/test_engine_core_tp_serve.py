"""tp_size=2 under a real `serve run`: the replica's engine core process drives the TP workers.
Killed by PID mid-stream, the core ends the stream with an error at once, the replica's
health check fails, the core's TP workers go with it, and Serve replaces the replica (a new
core and new workers) that answers as before."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ray_env import descendant_pids
from reliability_helpers import (
    CORE,
    CORE_KILL_OVERRIDES,
    REPLICA_HEADER,
    serve_app,
    short_completion,
    stream_and_kill,
    wait_for,
)

TP_WORKER = "ray::TPWorker"
REPLACE_S = 300  # a replica and its ranks starting beside other test workers on 2 cores
ERROR_WITHIN_S = 10.0  # the stream's error after the kill: at once, with room for a busy host
GONE_WITHIN_S = 60.0  # Ray notices the core (the workers' driver) is gone and ends its actors
ARGS = {"tiny_arch": "lfm2", "max_num_seqs": 4, "tp_size": 2, "engine_process": True}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp: Path = tmp_path_factory.mktemp("tpcore")
    with serve_app(tmp, ARGS, **CORE_KILL_OVERRIDES) as url:
        yield url


def test_core_killed_mid_stream_at_tp2_takes_its_workers_and_the_replica_is_replaced(
    base: str,
) -> None:
    want = wait_for(lambda: short_completion(base), REPLACE_S, "a healthy replica")
    old = want.headers[REPLICA_HEADER]
    (core,) = descendant_pids(CORE)
    workers = descendant_pids(TP_WORKER)
    assert len(workers) == 2
    body = {"prompt": "hello", "max_tokens": 500, "temperature": 0.0, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=60) as http:
        events, elapsed = stream_and_kill(http, body, lambda: os.kill(core, signal.SIGKILL), 1)
    assert events[-1] == "[DONE]" and elapsed < ERROR_WITHIN_S, (elapsed, events[-3:])
    assert "engine core" in json.loads(events[-2])["error"]["message"]
    health = httpx.get(f"{base}/health", timeout=30)
    assert health.status_code == 503 or health.headers.get(REPLICA_HEADER) != old

    def workers_gone() -> bool:
        return not set(workers) & set(descendant_pids(TP_WORKER))

    wait_for(workers_gone, GONE_WITHIN_S, "the killed core's TP workers to go")

    def replaced() -> httpx.Response | None:
        r = short_completion(base)
        return r if r is not None and r.headers[REPLICA_HEADER] != old else None

    again = wait_for(replaced, REPLACE_S, "Serve to replace the replica whose core died")
    assert again.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert len(descendant_pids(TP_WORKER)) == 2 and core not in descendant_pids(CORE)
