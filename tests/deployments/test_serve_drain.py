"""Drain: a replica that Serve scales away hands its sessions on through the session store.

Two LLMServer replicas of a tiny LFM2 share one `session_store`. Six sessions take turn 1,
spread across both (the router's least-loaded choice for a new session). Then Serve scales the
deployment to one replica (the autoscaling target drops to 1: Serve's own downscale path, which
stops the replica gracefully: ongoing requests finish, then its `__del__` shuts the engine down
and every held session spills to the store). Each session's turn 2 then goes to the survivor:
its own sessions resume from memory, the drained replica's from the store (the router's sticky
owner is gone, so the survivor imports the file on the miss). The oracle for the text is the
same turn-2 prompt without a session (a full prefill, asked last so it cannot warm the cache);
every turn 2 resumes at least turn 1's whole prompt (`cached_tokens`), and no request fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
from ray import serve
from ray_env import free_port, model_cache, private_ray
from reliability_helpers import wait_for
from test_serve_session_store import first_turn, second_turn
from test_serve_sessions import ForcedTarget

from deployments.serve.app import build_app, parse_args

SESSIONS = [f"d{i}" for i in range(6)]
REPLICA_HEADER = "x-shortconv-replica"


def ask(base: str, messages: list[dict[str, str]], sid: str | None) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-lfm2",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0.0,
        extra_headers={"x-session-id": sid} if sid else None,
    )
    r = raw.parse()
    details = r.usage.prompt_tokens_details if r.usage else None
    return {
        "text": r.choices[0].message.content or "",
        "cached": details.cached_tokens or 0 if details else 0,
        "prompt": r.usage.prompt_tokens if r.usage else 0,
        "replica": raw.headers[REPLICA_HEADER],
    }


def replicas_seen(base: str, n: int) -> set[str]:
    with httpx.Client(base_url=base, timeout=30) as http:
        seen = {http.get("/v1/internal/stats").headers[REPLICA_HEADER] for _ in range(6 * n)}
    return seen if len(seen) == n else set()


def gone(actor_name: str) -> bool:
    try:
        ray.get_actor(actor_name, namespace="serve")
    except ValueError:
        return True
    return False


@pytest.fixture(scope="module")
def drained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cache = model_cache(tmp_path_factory.getbasetemp())
    store = tmp_path_factory.mktemp("store")
    target = tmp_path_factory.mktemp("scale") / "target"
    target.write_text("2")
    with private_ray("scdr-", {"XDG_CACHE_HOME": str(cache)}):
        try:
            yield _run(store, target)
        finally:
            serve.shutdown()


def _run(store: Path, target: Path) -> dict[str, Any]:
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = parse_args(
        {"tiny_arch": "lfm2", "max_num_seqs": 8, "session_store": {"path": str(store)}}
    )
    policy = {"policy_function": ForcedTarget, "policy_kwargs": {"path": str(target)}}
    scaling = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 2}
    scaling.update(upscale_delay_s=0, downscale_delay_s=0, policy=policy)
    serve.run(build_app(args, autoscaling_config=scaling), name="drain", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    both = wait_for(lambda: replicas_seen(base, 2), 120, "two replicas")
    with ThreadPoolExecutor(len(SESSIONS)) as pool:
        turns = pool.map(lambda s: ask(base, first_turn(s), s), SESSIONS)
        one = dict(zip(SESSIONS, turns, strict=True))
    target.write_text("1")  # Serve stops one replica gracefully
    (survivor,) = wait_for(lambda: replicas_seen(base, 1), 120, "one replica left")
    (victim,) = both - {survivor}
    # NOTE: the router stops choosing a replica when its stop begins; it spills in its
    # destructor after its ongoing requests finish. A turn that came in between would
    # re-prefill (correct, not resumed), so the turns wait for the stop to finish.
    wait_for(lambda: gone(victim), 120, "the drained replica's stop to finish")
    two = {s: ask(base, second_turn(s, one[s]["text"]), s) for s in SESSIONS}
    oracle = {s: ask(base, second_turn(s, one[s]["text"]), None) for s in SESSIONS}
    stats = httpx.get(f"{base}/v1/internal/stats", timeout=30).json()
    found = {"both": both, "survivor": survivor, "one": one, "two": two, "oracle": oracle}
    return found | {"stats": stats}


def test_sessions_started_on_both_replicas(drained: dict[str, Any]) -> None:
    owners = {t["replica"] for t in drained["one"].values()}
    assert owners == drained["both"], owners
    assert drained["survivor"] in owners


@pytest.mark.parametrize("sid", SESSIONS)
def test_next_turn_resumes_its_history_with_equal_text(drained: dict[str, Any], sid: str) -> None:
    t, want = drained["two"][sid], drained["oracle"][sid]
    assert t["replica"] == drained["survivor"]
    assert t["text"] == want["text"]
    assert t["cached"] >= drained["one"][sid]["prompt"] > 0, (t, drained["one"][sid])


def test_the_drained_replicas_sessions_came_through_the_store(drained: dict[str, Any]) -> None:
    moved = [s for s, t in drained["one"].items() if t["replica"] != drained["survivor"]]
    st = drained["stats"]
    assert moved and st["session_state_bundles"]["restored"] == len(moved), (moved, st)
    assert not any(st["session_state_refused"].values()), st
