"""Sessions through the real stack: Ray Serve proxy -> SessionAffinityRouter -> LLMServer replicas
running the real engine on a tiny LFM2 checkpoint, driven with the official `openai` client.

One Serve instance for the module; the tests run in order and share it:
  1. sessions started on one replica keep their state when autoscaling adds a second;
  2. 8 sessions x 3 turns on 2 replicas: each turn resumes (cached_tokens > 0) on the replica
     that served the previous one, and matches the session-less (full prefill) answer exactly;
  3. killing a session's owner: its next turn is prefilled elsewhere (from whatever prefix that
     replica's cache holds), still correct;
  4. a streaming client that disconnects frees its slots and KV pages.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
from ray import serve
from ray_env import free_port, model_cache, private_ray
from reliability_helpers import wait_for

from deployments.serve.app import build_app, parse_args

APP = "sc"
MAX_TOKENS = 6
SESSION_HEADER = "x-session-id"
REPLICA_HEADER = "x-shortconv-replica"


class ForcedTarget:
    """Autoscaling policy whose target replica count is read from a file (the test's knob)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        try:
            return int(Path(self.path).read_text()), {}
        except (OSError, ValueError):
            return ctx.target_num_replicas, {}


@dataclass
class Service:
    base_url: str
    target_file: Path
    client: openai.OpenAI
    http: httpx.Client
    chats: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)  # session -> replica of its last turn


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    cache = model_cache(tmp_path_factory.getbasetemp())
    target = tmp_path_factory.mktemp("scale") / "target"
    target.write_text("1")
    with private_ray("scsv-", {"XDG_CACHE_HOME": str(cache)}):
        yield from _start_service(target)


def _start_service(target: Path) -> Iterator[Service]:
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = parse_args({"tiny_arch": "lfm2", "max_num_seqs": 8, "num_state_slots": 64})
        policy = {"policy_function": ForcedTarget, "policy_kwargs": {"path": str(target)}}
        scaling = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1}
        scaling.update(upscale_delay_s=0, downscale_delay_s=3600, policy=policy)
        serve.run(build_app(args, autoscaling_config=scaling), name=APP, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        with httpx.Client(base_url=base, timeout=60) as http:
            yield Service(base, target, client, http)
    finally:
        serve.shutdown()


def ask(svc: Service, messages: list[dict[str, str]], session: str | None) -> tuple[str, int, str]:
    """One greedy chat turn -> (text, cached_tokens, replica that served it)."""
    headers = {SESSION_HEADER: session} if session else None
    raw = svc.client.chat.completions.with_raw_response.create(
        model="tiny-lfm2",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_headers=headers,
    )
    r = raw.parse()
    details = r.usage.prompt_tokens_details if r.usage else None
    cached = details.cached_tokens if details and details.cached_tokens else 0
    return r.choices[0].message.content or "", cached, raw.headers[REPLICA_HEADER]


def take_turn(svc: Service, sid: str) -> dict[str, Any]:
    """The session's next turn, plus the same prompt without a session (full prefill)."""
    msgs = svc.chats.setdefault(sid, [])
    msgs.append({"role": "user", "content": f"{sid} turn {len(msgs) // 2}: tell me more."})
    text, cached, replica = ask(svc, msgs, sid)
    want, _, _ = ask(svc, msgs, None)
    msgs.append({"role": "assistant", "content": text})
    prev, svc.owner[sid] = svc.owner.get(sid), replica
    return {
        "sid": sid,
        "text": text,
        "want": want,
        "cached": cached,
        "replica": replica,
        "prev": prev,
    }


def turn_all(svc: Service, sids: list[str]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(sids)) as pool:
        return list(pool.map(lambda s: take_turn(svc, s), sids))


def replicas_seen(svc: Service, n: int) -> set[str]:
    seen = {svc.http.get("/v1/internal/stats").headers[REPLICA_HEADER] for _ in range(4 * n)}
    return seen if len(seen) >= n else set()


def stats_via(svc: Service, session: str) -> dict[str, Any]:
    r = svc.http.get("/v1/internal/stats", headers={SESSION_HEADER: session})
    return {**r.json(), "served_by": r.headers[REPLICA_HEADER]}


def test_sessions_survive_scale_up(svc: Service) -> None:
    early = [f"early-{i}" for i in range(4)]
    first = turn_all(svc, early)
    (only,) = {t["replica"] for t in first}
    assert all(t["cached"] == 0 and t["text"] == t["want"] for t in first), first
    svc.target_file.write_text("2")
    both = wait_for(lambda: replicas_seen(svc, 2), 120, "the second replica to serve")
    assert only in both  # scaled in place: the first replica (and its sessions) stayed
    for t in turn_all(svc, early):
        assert t["replica"] == only and t["cached"] > 0, t
        assert t["text"] == t["want"], t


def test_sticky_sessions_on_two_replicas(svc: Service) -> None:
    late = [f"late-{i}" for i in range(4)]
    everyone = [*svc.chats, *late]
    assert len(everyone) == 8
    for t in turn_all(svc, late):
        assert t["cached"] == 0 and t["text"] == t["want"], t
    for _ in range(2):  # turns 2-3 of the late sessions, 3-4 of the early ones
        for t in turn_all(svc, everyone):
            assert t["cached"] > 0 and t["replica"] == t["prev"], t
            assert t["text"] == t["want"], t
    assert len(set(svc.owner.values())) == 2, svc.owner  # sessions live on both replicas


def test_killed_owner_means_full_prefill_elsewhere(svc: Service) -> None:
    sid = "late-0"
    victim = svc.owner[sid]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    t = take_turn(svc, sid)
    # The session's state died with its owner. The new replica prefills what its own prefix
    # cache lacks (the session-less reference turns it served may have cached a prefix).
    assert t["replica"] != victim, t
    assert t["text"] == t["want"], t
    # The next turn sticks to the new owner and resumes there.
    t = take_turn(svc, sid)
    assert t["replica"] == t["prev"] and t["cached"] > 0 and t["text"] == t["want"], t


def test_client_disconnect_frees_slots(svc: Service) -> None:
    sid = "disconnect-me"
    before = stats_via(svc, sid)  # the router now pins sid to this replica
    body = {"model": "tiny-lfm2", "prompt": "count forever", "max_tokens": 1000}
    body.update(ignore_eos=True, stream=True, temperature=0.0)
    with httpx.Client(base_url=svc.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body, headers={SESSION_HEADER: sid}) as r:
            assert r.headers[REPLICA_HEADER] == before["served_by"]
            got: list[str] = []
            for line in r.iter_lines():
                got += [line] if line.startswith("data: ") else []
                if len(got) == 3:
                    # NOTE: read while the stream is open: leaving this loop closes the
                    # connection (httpx drops it), which is the disconnect under test.
                    during = stats_via(svc, sid)
                    break
            assert len(got) == 3 and "error" not in got[-1], got
            assert during["served_by"] == before["served_by"]
            assert during["num_running"] == 1 and during["slots_used"] > before["slots_used"]

    def outside_cache(stats: dict[str, Any]) -> tuple[int, int]:
        """Slots and pages held by requests and sessions (the prefix cache's excluded: the
        aborted prompt's end-of-prompt checkpoint stays cached, evictable)."""
        return (
            stats["slots_used"] - stats["prefix_cache_checkpoints"],
            stats["kv_pages_used"] - stats["prefix_cache_pages"],
        )

    def freed() -> dict[str, Any] | None:
        now = stats_via(svc, sid)
        done = now["num_running"] == 0 and outside_cache(now) == outside_cache(before)
        return now if done else None

    after = wait_for(freed, 30, "the aborted request's slots to be freed")
    aborts = after["finished_by_reason"].get("abort", 0)
    assert aborts == before["finished_by_reason"].get("abort", 0) + 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 1000


def test_sampling_fields_reach_the_real_engine(svc: Service) -> None:
    kw: dict[str, Any] = {"model": "tiny-lfm2", "prompt": "The quick brown fox", "max_tokens": 8}
    greedy = svc.client.completions.create(**kw, temperature=0.0, logprobs=2)
    lp = greedy.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == greedy.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(row) <= 2 for row in lp.top_logprobs or [])
    sampled = [
        svc.client.completions.create(
            **kw, temperature=0.9, top_p=0.9, seed=7, extra_body={"top_k": 20, "min_p": 0.01}
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # a seed makes sampling reproducible
    text = greedy.choices[0].text
    stop = text[2:4]
    if len(stop) == 2 and stop.isascii() and stop.isprintable():  # random models emit odd bytes
        stopped = svc.client.completions.create(**kw, temperature=0.0, stop=[stop])
        assert stopped.choices[0].text == text[: text.find(stop)]
        assert stopped.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as exc:
        svc.client.completions.create(**kw, n=17)  # above the engine's max_n (16)
    assert exc.value.status_code == 400 and exc.value.body["param"] == "n"  # type: ignore[index]
