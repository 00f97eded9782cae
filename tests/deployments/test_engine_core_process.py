"""The engine in its own core process under a real `serve run`: the replica spawns and owns
it; killed by PID mid-stream, in-flight requests end with an error at once (a streamed one an
error event and [DONE], a whole one a 5xx), the health check fails, Serve replaces the replica
(and so the core), and the next request is answered as before."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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

REPLACE_S = 300  # a replica's start beside other test workers on 2 cores
ERROR_WITHIN_S = 10.0  # the stream's error after the kill: at once, with room for a busy host
ARGS = {"tiny_arch": "lfm2", "max_num_seqs": 4, "engine_process": True}
ARGS_NICENESS = 0  # AppArgs.engine_niceness's default


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp: Path = tmp_path_factory.mktemp("core")
    with serve_app(tmp, ARGS, **CORE_KILL_OVERRIDES) as url:
        yield url


def test_the_replica_owns_one_core_process_and_reports_its_start(base: str) -> None:
    assert short_completion(base) is not None
    assert len(descendant_pids(CORE)) == 1
    stats = httpx.get(f"{base}/v1/internal/stats", timeout=30).json()
    core = stats["startup"]["core"]
    assert core["who"] == "core" and core["rss_bytes"] > 0
    assert {"checkpoint", "weights", "engine"} <= {name for name, _ in core["phases"]}
    assert "core_process" in dict(stats["startup"]["phases"])


def _stat(path: Path) -> list[str]:
    """/proc stat fields after the command name: [0] state, [1] ppid, ..., [16] nice."""
    return path.read_text().rsplit(")", 1)[1].split()


def test_the_core_runs_at_engine_niceness_not_at_rays_worker_niceness(base: str) -> None:
    assert short_completion(base) is not None  # a step ran
    (pid,) = descendant_pids(CORE)
    replica = int(_stat(Path(f"/proc/{pid}/stat"))[1])
    # Ray starts workers, the replica among them, at nice 15 (19 under a niced pytest): what
    # the core would inherit.
    assert int(_stat(Path(f"/proc/{replica}/stat"))[16]) > ARGS_NICENESS
    # Every thread: torch's OpenMP pool (when the core has more than one torch thread) is
    # started after the move and inherits it.
    threads = list(Path(f"/proc/{pid}/task").iterdir())
    assert {int(_stat(t / "stat")[16]) for t in threads} == {ARGS_NICENESS}


def test_core_killed_mid_stream_ends_requests_in_an_error_then_the_replica_is_replaced(
    base: str,
) -> None:
    want = wait_for(lambda: short_completion(base), REPLACE_S, "a healthy replica")
    old = want.headers[REPLICA_HEADER]
    body = {"prompt": "hello", "max_tokens": 500, "temperature": 0.0, "ignore_eos": True}
    # NOTE: the whole request runs to nearly the model's length: with the core at nice 0 and
    # the replica at Ray's nice 15, 500 tokens could finish before the stream's first events
    # were relayed, and the request was no longer in flight when the core died.
    long = {**body, "max_tokens": 1000}
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=base, timeout=60) as http:
        whole = pool.submit(http.post, "/v1/completions", json=long)  # in flight too
        killed: list[int] = []

        def kill() -> None:
            killed.extend(descendant_pids(CORE))
            os.kill(killed[0], signal.SIGKILL)

        events, elapsed = stream_and_kill(http, body, kill, after=1)
        assert len(killed) == 1
        assert events[-1] == "[DONE]" and elapsed < ERROR_WITHIN_S, (elapsed, events[-3:])
        err = json.loads(events[-2])["error"]
        assert "engine core" in err["message"], err
        failed = whole.result()
        assert failed.status_code in (500, 503) and "error" in failed.json(), failed.text
    health = httpx.get(f"{base}/health", timeout=30)
    assert health.status_code == 503 or health.headers.get(REPLICA_HEADER) != old

    def replaced() -> httpx.Response | None:
        r = short_completion(base)
        return r if r is not None and r.headers[REPLICA_HEADER] != old else None

    again = wait_for(replaced, REPLACE_S, "Serve to replace the replica whose core died")
    assert again.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    wait_for(lambda: len(descendant_pids(CORE)) == 1, 60, "the old core gone, one new one")
    assert killed[0] not in descendant_pids(CORE)
