"""Disaggregated prefill through `serve run`: greedy output equals the same app without it.

Each architecture from its shipped YAML, plain (the oracle: one LLMServer) and disaggregated
(a PrefillServer deployment hands each prompt's state to the decode LLMServer as a state
bundle over Ray's object store), as two applications of one `serve run`: LFM2 and ZAYA1 in one
run, then LFM2-MoE, LFM3 and LFM2-VL one run each (pytest groups a module fixture's params, so
one run is up at a time). LFM2's prefill runs at TP 1 and its decode at TP 2, so every bundle
is re-sliced on import; LFM3's bundles carry sliding-window pages; LFM2-VL's chat has an image.
Compared: token-id completions without a session and a chat session's two turns, by text and
per-token logprobs (a tiny random model's text often survives a wrong state; its logprobs do
not), and the session's second turn resumes its history (`cached_tokens`) on the decode
replica holding it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
import yaml
from image_server import data_url, image_bytes
from ray_env import model_cache
from reliability_helpers import wait_for
from serve_apps import ROOT
from test_serve_session_store import first_turn, second_turn

from deployments.serve.serve_run import serve_run

PROMPTS = [
    [int(t) for t in torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n))]
    for n in (5, 23, 61)
]
SPLITS = {
    "lfm2": {
        "tp_size": 2,
        "disaggregation": {"prefill_replicas": 1, "decode_replicas": 1, "prefill_tp_size": 1},
    },
    "zaya1": {"disaggregation": {"prefill_replicas": 1, "decode_replicas": 1}},
    "lfm2_moe": {"disaggregation": {"prefill_replicas": 1, "decode_replicas": 1}},
    "lfm3": {"disaggregation": {"prefill_replicas": 1, "decode_replicas": 1}},
    "lfm2_vl": {"disaggregation": {"prefill_replicas": 1, "decode_replicas": 1}},
}
# The `serve run`s, one after the other: several architectures in one where they fit.
GROUPS = {"lfm2+zaya1": ("lfm2", "zaya1"), "lfm2_moe": ("lfm2_moe",), "lfm3": ("lfm3",)}
GROUPS |= {"lfm2_vl": ("lfm2_vl",)}
RED = image_bytes((40, 24), "png", seed=1)


def application(arch: str, disaggregated: bool, first: bool) -> dict[str, Any]:
    """The shipped YAML's app; disaggregated, without its replica bounds (the split sets
    them). NOTE: a tenth of a CPU per replica, so that four apps fit a 2-core Ray."""
    config = yaml.safe_load((ROOT / "deployments" / f"{arch}.yaml").read_text())
    app = config["applications"][0]
    args = {**app["args"], "replica_num_cpus": 0.1}
    if disaggregated:
        args = {k: v for k, v in args.items() if k not in ("min_replicas", "max_replicas")}
        args |= SPLITS[arch]
    name = f"{arch}-disagg" if disaggregated else arch
    route = "/" if first else f"/{name}"  # NOTE: `serve run` is ready once / answers
    return {**app, "name": name, "route_prefix": route, "args": args}


def base_url(url: str, app: dict[str, Any]) -> str:
    return url + app["route_prefix"].rstrip("/")


def answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def post(base: str, path: str, body: dict[str, Any], sid: str | None) -> dict[str, Any]:
    headers = {"x-session-id": sid} if sid else {}
    r = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=300)
    r.raise_for_status()
    return r.json()


def answer(text: str, logprobs: list[Any], usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") or 0
    return {"text": text, "logprobs": logprobs, "cached": cached, "prompt": usage["prompt_tokens"]}


def complete(base: str, prompt: list[int], sid: str | None = None) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 0}
    got = post(base, "/v1/completions", body | {"ignore_eos": True}, sid)
    choice = got["choices"][0]
    lps = list(zip(choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"], strict=True))
    return answer(choice["text"], lps, got["usage"])


def chat(base: str, messages: list[dict[str, Any]], sid: str | None) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0.0, "logprobs": True}
    got = post(base, "/v1/chat/completions", body, sid)
    choice = got["choices"][0]
    lps = [(c["token"], c["logprob"]) for c in choice["logprobs"]["content"]]
    return answer(choice["message"]["content"] or "", lps, got["usage"])


def image_turn(base: str) -> dict[str, Any]:
    """A chat turn with an image (a vision model's prompt: its tiles' tokens are handed off)."""
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": data_url(RED)}},
    ]
    return chat(base, [{"role": "user", "content": content}], None)


# Requests beyond the common ones, by architecture.
EXTRA: dict[str, Callable[[str], dict[str, Any]]] = {"lfm2_vl": image_turn}


def serve_all(base: str, arch: str) -> dict[str, Any]:
    """Every request of the comparison, in one order, on one app."""
    sid = f"s-{arch}"
    one = chat(base, first_turn(sid), sid)
    two = chat(base, second_turn(sid, one["text"]), sid)
    plain = [complete(base, p) for p in PROMPTS]
    extra = EXTRA[arch](base) if arch in EXTRA else None
    stats = httpx.get(f"{base}/v1/internal/stats", timeout=60).json()
    return {"one": one, "two": two, "plain": plain, "extra": extra, "stats": stats}


@pytest.fixture(scope="module", params=list(GROUPS))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """One `serve run` for the group's architectures, plain and disaggregated: the answers
    by app name (`lfm2`, `lfm2-disagg`, ...)."""
    archs = GROUPS[request.param]
    apps = [application(a, d, (a, d) == (archs[0], False)) for a in archs for d in (False, True)]
    config = {"proxy_location": "EveryNode", "applications": apps}
    env = {"XDG_CACHE_HOME": str(model_cache(tmp_path_factory.getbasetemp()))}
    with serve_run(config, 600.0, env=env) as (url, _):
        found: dict[str, Any] = {"archs": archs}
        for app in apps:
            base = base_url(url, app)
            wait_for(lambda b=base: answers(b), 600, f"{app['name']} to answer")
            found[app["name"]] = serve_all(base, app["name"].split("-")[0])
        yield found


def same_logprobs(got: list[Any], want: list[Any], tol: float) -> bool:
    """Equal tokens, logprobs equal up to fp32 reduction order (`tol`: TP 2 sums in
    another order than TP 1)."""
    tokens_equal = [t for t, _ in got] == [t for t, _ in want]
    close = all(abs(a - b) < tol for (_, a), (_, b) in zip(got, want, strict=True))
    return bool(got) and tokens_equal and close


TOL = 1e-4  # fp32; TP 2 sums in another order than TP 1


def test_completions_equal_the_plain_app(served: dict[str, Any]) -> None:
    for arch in served["archs"]:
        got, want = served[f"{arch}-disagg"]["plain"], served[arch]["plain"]
        for g, w, p in zip(got, want, PROMPTS, strict=True):
            assert g["text"] == w["text"] and same_logprobs(g["logprobs"], w["logprobs"], TOL)
            assert g["cached"] == len(p) - 1, (arch, g)  # handed off: only the last token ran
            assert w["cached"] == 0


def test_session_turns_equal_the_plain_app(served: dict[str, Any]) -> None:
    for arch in served["archs"]:
        got, want = served[f"{arch}-disagg"], served[arch]
        for turn in ("one", "two"):
            g, w = got[turn], want[turn]
            assert g["text"] == w["text"], (arch, turn, g, w)
            assert same_logprobs(g["logprobs"], w["logprobs"], TOL), (arch, turn, g, w)
        # Turn 2 went to the decode replica holding the session and resumed its history there.
        assert got["two"]["cached"] >= got["one"]["prompt"] > 0, (arch, got)


def test_an_image_prompt_equals_the_plain_app(served: dict[str, Any]) -> None:
    archs = [a for a in served["archs"] if a in EXTRA]
    if not archs:
        pytest.skip("no vision model in this run")
    for arch in archs:
        g, w = served[f"{arch}-disagg"]["extra"], served[arch]["extra"]
        assert g["text"] == w["text"] and same_logprobs(g["logprobs"], w["logprobs"], TOL), (g, w)
        assert g["cached"] == g["prompt"] - 1 and w["cached"] == 0, (g, w)


def test_handoffs_are_counted_with_their_bytes(served: dict[str, Any]) -> None:
    for arch in served["archs"]:
        st = served[f"{arch}-disagg"]["stats"]
        handoff = st["handoff"]
        # turn 1, the three completions (and an image turn) were handed off; turn 2 stayed
        # local (held).
        n = 1 + len(PROMPTS) + (arch in EXTRA)
        assert handoff["imported"] == n and handoff["local"] == 1, (arch, handoff)
        assert handoff["refused"] == handoff["failed"] == 0, handoff
        assert handoff["bytes"] > 0 and handoff["per_request"]["transfer_s"] >= 0, handoff
        assert st["session_state_bundles"]["imported"] == n, st
        assert "handoff" not in served[arch]["stats"]
