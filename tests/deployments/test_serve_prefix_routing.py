"""Prefix-aware routing through `serve run` (issue #18): no session header, 2 LLMServer replicas,
16 chat requests sharing a 512-character system prompt (512 tokens: the tiny tokenizer is
byte-level), each with its own user message.

One `serve run` holds two applications on the same tiny LFM2 checkpoint: `/` with prefix caching
on and 2 replicas, `/off` with caching off (the reference outputs). Checks: every request lands
on the replica that served the prefix first (16 of 16, nothing spills at this load); after the
first request there, each reports `cached_tokens >= 448`; outputs equal the caching-off ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from ray_env import model_cache
from reliability_helpers import REPLICA_HEADER, replica_stats, wait_for

from deployments.serve.app import ROUTING_STATS_PERIOD_S
from deployments.serve.serve_run import serve_run

MODEL = "tiny-lfm2"
SYSTEM = "".join(f"rule {i:03d}: answer briefly. " for i in range(23))[:512]
NUM_REQUESTS = 16
MAX_TOKENS = 6
MIN_CACHED = 448
NEAR_TIE = 1e-3  # logprob margin under which greedy argmax may flip between kernels


def app(name: str, prefix: str, caching: bool, replicas: int) -> dict[str, Any]:
    args = {"tiny_arch": "lfm2", "max_num_seqs": 8, "enable_prefix_caching": caching}
    args.update(min_replicas=replicas, max_replicas=replicas)
    return {
        "name": name,
        "route_prefix": prefix,
        "import_path": "deployments.serve.app:build",
        "args": args,
    }


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = {"applications": [app("on", "/", True, 2), app("off", "/off", False, 1)]}
    env = {"XDG_CACHE_HOME": str(model_cache(tmp_path_factory.getbasetemp()))}
    with serve_run(config, timeout_s=240, env=env) as (url, _log):
        wait_for(lambda: _ok(f"{url}/off/v1/models"), 120, "the caching-off app")
        yield url


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def messages(i: int) -> list[dict[str, str]]:
    user = f"request {i}: " + "why is the sky blue? " * (1 + i % 3)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def ask(client: openai.OpenAI, i: int) -> dict[str, Any]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages(i),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    r = raw.parse()
    details = r.usage.prompt_tokens_details if r.usage else None
    steps = (r.choices[0].logprobs.content or []) if r.choices[0].logprobs else []
    return {
        "i": i,
        "replica": raw.headers[REPLICA_HEADER],
        "cached": (details.cached_tokens or 0) if details else 0,
        "tokens": [s.token for s in steps],
        "top": [[t.logprob for t in s.top_logprobs] for s in steps],
    }


def same_greedy(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Tokens equal, or equal up to a position where the reference's top-2 is a near-tie."""
    for k, (a, b) in enumerate(zip(got["tokens"], want["tokens"], strict=True)):
        if a != b:
            top = want["top"][k]
            return len(top) == 2 and math.isclose(top[0], top[1], abs_tol=NEAR_TIE)
    return True


def test_shared_prefix_follows_its_replica(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    off = openai.OpenAI(base_url=f"{base_url}/off/v1", api_key="unused", max_retries=0, timeout=60)
    got = [ask(client, 0)]
    # Long enough for the holder's report to reach every router (not only the one that sent it).
    time.sleep(2 * ROUTING_STATS_PERIOD_S + 1)
    got.append(ask(client, 1))
    with ThreadPoolExecutor(4) as pool:
        for start in range(2, NUM_REQUESTS, 4):  # small concurrent waves
            got += pool.map(lambda i: ask(client, i), range(start, min(start + 4, NUM_REQUESTS)))
        want = list(pool.map(lambda i: ask(off, i), range(NUM_REQUESTS)))

    # The router sent every request to the replica that served the prefix first.
    holder = got[0]["replica"]
    assert [g["replica"] for g in got] == [holder] * NUM_REQUESTS, got
    # ... and there each request after the first resumed the shared prompt from the cache.
    cached = [g["cached"] for g in got]
    assert cached[0] == 0 and all(c >= MIN_CACHED for c in cached[1:]), cached
    assert all(w["cached"] == 0 for w in want)
    for g, w in zip(got, want, strict=True):
        assert same_greedy(g, w), (g, w)
    # Two replicas were up all along: requests without a prefix key spread over both.
    with httpx.Client(base_url=base_url, timeout=30) as http:
        seen = set(replica_stats(http, 2))
    assert len(seen) == 2 and holder in seen, seen
