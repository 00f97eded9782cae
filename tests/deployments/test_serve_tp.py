"""tp_size=2 under Serve: the TP workers live in the replica's placement group, and a dead
worker fails the replica's health check, so Serve replaces the replica (and its workers); a
worker killed mid-stream ends in-flight requests with an error, never a hang."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import ray
from ray import serve
from ray_env import descendant_pids, free_port, model_cache, private_ray
from reliability_helpers import stream_and_kill

from deployments.serve.app import build_app, parse_args

REPLICA_HEADER = "x-shortconv-replica"
# Serve notices a dead TP worker by a failed health check, then starts a replica: well within a
# minute alone, several beside two other test workers on 2 cores.
REPLACE_S = 300


def wait_for(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def tp_worker_pids() -> list[int]:
    """TP worker processes of *our* Ray runtime."""
    return descendant_pids("ray::TPWorker")


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cache = model_cache(tmp_path_factory.getbasetemp())
    with private_ray("scsv-tp-", {"XDG_CACHE_HOME": str(cache)}):
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            args = parse_args({"tiny_arch": "lfm2", "tp_size": 2, "max_num_seqs": 4})
            app = build_app(
                args, num_replicas=1, health_check_period_s=1, health_check_timeout_s=20
            )
            serve.run(app, name="tp", route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()


def complete(base: str) -> httpx.Response:
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0.0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def test_tp_workers_in_replica_placement_group_and_health(base_url: str) -> None:
    first = complete(base_url)
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 6
    (pg,) = ray.util.placement_group_table().values()  # the replica's; the executor made none
    assert pg["strategy"] == "STRICT_PACK" and pg["state"] == "CREATED"
    assert [b["CPU"] for b in pg["bundles"].values()] == [1.0, 0.5]  # replica+rank 0, rank 1
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200

    pids = tp_worker_pids()
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGKILL)  # rank 1 dies under a live replica
    old = first.headers[REPLICA_HEADER]

    def replaced() -> bool:
        try:
            r = complete(base_url)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.headers[REPLICA_HEADER] != old

    wait_for(replaced, REPLACE_S, "Serve to replace the replica whose TP worker died")
    again = complete(base_url)
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert len(tp_worker_pids()) == 2 and pids[0] not in tp_worker_pids()


def test_worker_killed_mid_stream_ends_in_an_error_then_the_replica_is_replaced(
    base_url: str,
) -> None:
    """In-flight requests get a clean error in bounded time (a streamed one an error event and
    [DONE], not a hang); the replica turns unhealthy, is replaced, and answers correctly again."""
    want = wait_for(lambda: ok_or_none(base_url), REPLACE_S, "a healthy replica")
    old = want.headers[REPLICA_HEADER]
    body = {"prompt": "hello", "max_tokens": 500, "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=base_url, timeout=60) as http:
        whole = pool.submit(http.post, "/v1/completions", json=body)  # in flight too
        events, elapsed = stream_and_kill(
            http, body, lambda: os.kill(tp_worker_pids()[-1], signal.SIGKILL)
        )
        assert events[-1] == "[DONE]" and elapsed < 30, (elapsed, events[-3:])
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_error" and "TP rank" in err["message"], err
        failed = whole.result()
        assert failed.status_code in (500, 503) and "error" in failed.json(), failed.text

    def replaced() -> httpx.Response | None:
        r = ok_or_none(base_url)
        return r if r is not None and r.headers[REPLICA_HEADER] != old else None

    again = wait_for(replaced, REPLACE_S, "Serve to replace the replica whose TP worker died")
    assert again.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]


def ok_or_none(base: str) -> httpx.Response | None:
    try:
        r = complete(base)
    except httpx.HTTPError:
        return None
    return r if r.status_code == 200 else None
