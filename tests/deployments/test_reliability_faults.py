"""Abort and exhaustion paths through the real service, each ending with the replica back at idle
(no slot, KV page, session or queued request left) and other requests' greedy outputs unchanged:

  * 4x more sessions than state slots, with a KV pool small enough that decode growth preempts:
    every turn completes and equals its solo run (idle sessions are evicted LRU, a preempted
    request is recomputed, nobody reads another's state);
  * an engine error inside one request fails that request alone (500 / stream error event);
  * the per-request timeout (request_timeout_s) aborts a request, streamed or not (504);
  * a client that disconnects, streamed or not, is aborted.

The replica runs `tests.reliability_helpers:faulty_engine`: the real engine with faults keyed on
the request's seed and every preemption logged to a file. TP worker deaths are in
tests/deployments/test_serve_tp.py (they need a tp_size=2 replica).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_helpers import (
    FAULT_KV_PAGES_ENV,
    FAULT_LOG_ENV,
    POISON_SEED,
    SESSION_HEADER,
    SLOW_SEED,
    replica_stats,
    serve_app,
    sse_data,
    stream_text,
    wait_idle,
)

MODEL = "tiny-lfm2"
SLOTS = 4  # live state slots (num_state_slots - 1 scratch)
SESSIONS = 4 * SLOTS
KV_PAGES = 22  # of 8 tokens: two first turns fit, their decode growth does not
TIMEOUT_S = 30.0  # long enough for 16 sessions queueing on 4 slots on a loaded 2-core runner
ARGS = {
    "tiny_arch": "lfm2",
    "max_num_seqs": 8,  # more than the slots: slots, not the batch size, are what run out
    "num_state_slots": SLOTS + 1,
    "num_checkpoint_slots": 1,  # prefix-cache checkpoints compete for the same few slots
    "max_model_len": 160,  # one whole sequence always fits the KV pool (no livelock)
    "session_ttl_s": 4.0,  # kept sessions go soon after a test, so idle means empty
    "request_timeout_s": TIMEOUT_S,
}


@dataclass
class Svc:
    http: httpx.Client
    fault_log: Path


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Svc]:
    tmp = tmp_path_factory.mktemp("svc")
    log = tmp / "preemptions.log"
    env = {FAULT_LOG_ENV: str(log), FAULT_KV_PAGES_ENV: str(KV_PAGES + 1)}
    factory = "tests.reliability_helpers:faulty_engine"
    with serve_app(tmp, ARGS, env, num_replicas=1, engine_factory=factory) as base:
        with httpx.Client(base_url=base, timeout=120) as http:
            yield Svc(http, log)


def chat(messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0.0, **kw}


def answer(http: httpx.Client, body: dict[str, Any], session: str | None = None) -> str:
    headers = {SESSION_HEADER: session} if session else None
    r = http.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def counters(svc: Svc) -> dict[str, int]:
    (stats,) = replica_stats(svc.http, 1).values()
    return stats["finished_by_reason"]


def test_slot_exhaustion_sessions_wait_evict_and_preempt(svc: Svc) -> None:
    # Long first turns (~80 tokens, ten 8-token pages): the pool holds two, and each session
    # also parks its prompt state in a spare slot, so sessions wait for slots and evict LRU.
    story = "tell me a long story " * 2
    firsts = [user(f"Session {i:02d} asks: {story}") for i in range(SESSIONS)]
    seconds = [user(f"And then, {i}?") for i in range(SESSIONS)]
    want1 = [answer(svc.http, chat([m])) for m in firsts]  # solo, no session: the truth
    want2 = [
        answer(svc.http, chat([m, {"role": "assistant", "content": a}, s]))
        for m, a, s in zip(firsts, want1, seconds, strict=True)
    ]
    evictions0 = replica_stats(svc.http, 1).popitem()[1]["session_evictions"]

    def session(i: int) -> tuple[str, str]:
        sid = f"slot-exhaustion-{i}"
        got1 = answer(svc.http, chat([firsts[i]]), sid)
        msgs = [firsts[i], {"role": "assistant", "content": got1}, seconds[i]]
        return got1, answer(svc.http, chat(msgs), sid)

    with ThreadPoolExecutor(SESSIONS) as pool:
        got = list(pool.map(session, range(SESSIONS)))
    assert [g[0] for g in got] == want1
    assert [g[1] for g in got] == want2
    (stats,) = replica_stats(svc.http, 1).values()
    assert stats["slots_total"] == SLOTS + 1 and stats["session_evictions"] > evictions0
    assert svc.fault_log.exists() and svc.fault_log.read_text().strip(), "nothing was preempted"
    wait_idle(svc.http, 1)


def test_engine_error_in_one_request_fails_only_that_request(svc: Svc) -> None:
    others = [chat([user(f"Bystander {i} says hello")], max_tokens=16) for i in range(3)]
    want = [answer(svc.http, body) for body in others]
    poison = chat([user("poisoned")], max_tokens=32, ignore_eos=True, seed=POISON_SEED)
    errors0 = counters(svc).get("error", 0)

    def run(i: int) -> Any:
        if i < len(others):
            return answer(svc.http, others[i])
        if i == len(others):
            return svc.http.post("/v1/chat/completions", json=poison)
        return svc.http.post("/v1/chat/completions", json={**poison, "stream": True})

    with ThreadPoolExecutor(len(others) + 2) as pool:
        *got, whole, streamed = pool.map(run, range(len(others) + 2))
    assert got == want
    err = whole.json()["error"]
    assert whole.status_code == 500 and err["code"] == "engine_error", whole.text
    assert "injected fault" in err["message"]
    events = sse_data(streamed.text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error"
    assert svc.http.get("/health").status_code == 200  # the replica lives on
    assert counters(svc).get("error", 0) == errors0 + 2
    wait_idle(svc.http, 1)
    assert answer(svc.http, others[0]) == want[0]


def test_request_timeout_aborts_and_frees(svc: Svc) -> None:
    slow = chat([user("never finishes")], max_tokens=120, ignore_eos=True, seed=SLOW_SEED)
    aborts0 = counters(svc).get("abort", 0)
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(svc.http.post, "/v1/chat/completions", json=slow)
        streamed = pool.submit(svc.http.post, "/v1/chat/completions", json={**slow, "stream": True})
        whole_r, streamed_r = whole.result(), streamed.result()
    elapsed = time.monotonic() - t0
    assert TIMEOUT_S - 1 < elapsed < TIMEOUT_S + 20, elapsed
    err = whole_r.json()["error"]
    assert whole_r.status_code == 504 and err["code"] == "request_timeout", whole_r.text
    events = sse_data(streamed_r.text)
    assert streamed_r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert stream_text(events[:-2])  # it did stream tokens before the deadline
    wait_idle(svc.http, 1)
    assert counters(svc).get("abort", 0) == aborts0 + 2


def test_client_disconnects_abort_and_free(svc: Svc) -> None:
    slow = chat([user("talk forever")], max_tokens=120, ignore_eos=True, seed=SLOW_SEED)
    aborts0 = counters(svc).get("abort", 0)
    with svc.http.stream("POST", "/v1/chat/completions", json={**slow, "stream": True}) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert [next(lines) for _ in range(2)]  # two chunks, then hang up mid-stream
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        svc.http.post("/v1/chat/completions", json=slow, timeout=2.0)
    wait_idle(svc.http, 1)
    assert counters(svc).get("abort", 0) == aborts0 + 2
