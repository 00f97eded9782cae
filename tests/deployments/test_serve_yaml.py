"""`serve run deployments/<model>.yaml` as a user runs it, answered through the `openai` client.

Each YAML runs in a `serve run` subprocess started from the repository root (nothing installed:
the import path `deployments.serve.app:build` resolves from the working directory), with an empty
tiny-checkpoint cache, its own Ray temp dir and a free port patched into a copy of the YAML.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from serve_apps import second_turn_cached_tokens

from deployments.frontend.config.args import AppArgs
from deployments.serve.app import deployment_options, parse_args
from deployments.serve.cpu_plan import cpu_plan
from deployments.serve.serve_run import serve_run
from deployments.serve.server import gil_interval_ms
from workers.cpu_threads import threads_for

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0


@pytest.mark.parametrize("path", sorted((ROOT / "deployments").glob("*.yaml")), ids=str)
def test_yamls_override_serve_options_only_on_purpose(path: Path) -> None:
    """The Serve options are derived from the args (deployments/serve/app.py). A YAML's LLMServer
    entry may only change one (restating a derived value would go stale when the args change),
    and never `autoscaling_config`, which Serve replaces whole (the derived target with it)."""
    (app,) = yaml.safe_load(path.read_text())["applications"]
    derived = deployment_options(parse_args(app["args"]))
    for entry in app.get("deployments", []):
        assert entry["name"] == "LLMServer"
        assert "autoscaling_config" not in entry, "set min_replicas / max_replicas in args"
        for key, value in entry.items():
            assert key == "name" or value != derived.get(key), f"{key} restates the default"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")  # empty: the first start builds the model


# YAML file, and the args a user changes in it: ZAYA1's 2 KV heads split over 2 gloo ranks
# (rank 0 the current-token value head, rank 1 the previous-token one).
SERVED = {
    "zaya1": ("zaya1", {}),
    "zaya1-tp2": ("zaya1", {"tp_size": 2}),
    "lfm2": ("lfm2", {}),
    "lfm2_moe": ("lfm2_moe", {}),
    "lfm3": ("lfm3", {}),
}


@pytest.fixture(params=list(SERVED))
def served(request: pytest.FixtureRequest, cache_dir: Path) -> Iterator[tuple[str, AppArgs]]:
    name, changes = SERVED[request.param]
    config = yaml.safe_load((ROOT / "deployments" / f"{name}.yaml").read_text())
    config["applications"][0]["args"].update(changes)
    args = parse_args(config["applications"][0]["args"])  # the YAML's args are valid AppArgs
    with serve_run(config, START_TIMEOUT_S, env={"XDG_CACHE_HOME": str(cache_dir)}) as (base, _):
        yield base, args


def test_serve_run_yaml_answers_openai_client(served: tuple[str, AppArgs]) -> None:
    served, args = served
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = [m.id for m in client.models.list().data]
    messages = [{"role": "user", "content": "Hello! Who are you?"}]
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0.0,  # type: ignore[arg-type]
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage is not None
    assert 1 <= r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content  # greedy: the same answer either way
    assert (
        chunks[-1].usage is not None
        and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    )
    _answers_a_json_schema(client, model)
    assert httpx.get(f"{served}/health", timeout=30).status_code == 200
    startup = httpx.get(f"{served}/v1/internal/stats", timeout=30).json()["startup"]
    phases = dict(startup["phases"])  # the replica's start, phase by phase, and its memory
    assert {"checkpoint", "engine", "loop"} <= set(phases) and startup["rss_bytes"] > 0
    assert ("weights" in phases) == (args.tp_size == 1)  # else each rank reports its own
    if args.tp_size == 1:  # quantized at load, and only the int8 copy kept
        assert ("quantize" in phases) == (args.quantization == "int8")
        assert ("int8" in startup["weight_bytes"]) == (args.quantization == "int8")
    assert len(startup["ranks"]) == (args.tp_size if args.tp_size > 1 else 0)
    # The YAMLs give the replica the machine (replica_num_cpus: all), split with its ranks.
    plan = cpu_plan("all", args.tp_size)
    if args.tp_size == 1:
        assert startup["torch_threads"] == threads_for(plan.replica)
    # In the replica: Python's 5 ms where the core runs the engine, unless the YAML sets one.
    assert startup["gil_switch_interval_ms"] == (gil_interval_ms(args) or 5.0)
    for rank in startup["ranks"]:
        assert rank["who"].endswith(f"({threads_for(plan.per_worker)} threads)")
    bad = httpx.post(
        f"{served}/v1/chat/completions", json={"model": model, "messages": [], "n": 10_000}
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    # A second turn of a session resumes from the first one's kept state.
    assert second_turn_cached_tokens(client, model, "yaml-session") > 0
    asyncio.run(_burst_past_the_admission_limit(served, model, args.admission_limit))


def _answers_a_json_schema(client: openai.OpenAI, model: str) -> None:
    """Structured output through the YAML's app: the grammar holds on any tiny random model."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A name and a number, as JSON."}],
        max_tokens=64,
        temperature=0.0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pair", "schema": schema, "strict": True},
        },  # type: ignore[arg-type]
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0]  # the grammar closed the object
    value = json.loads(r.choices[0].message.content or "")
    assert set(value) == {"name", "n"} and 0 <= value["n"] <= 9 and len(value["name"]) <= 8


async def _burst_past_the_admission_limit(base: str, model: str, limit: int) -> None:
    """With the YAML's own settings, `limit + 8` concurrent requests reach the replica (Serve's
    cap is derived above the engine's) and the replica refuses the overshoot itself: OpenAI
    503s with Retry-After, nothing else fails, and every slot is free again afterwards.

    NOTE: the requests are chat streams with no `max_tokens` (they run to the context's end) and
    are held open until every request has its answer: an admitted stream answers 200 at once
    (its role chunk) and keeps its admission until it ends. On a loaded machine the burst can
    take longer to arrive than a stream takes to reach the context's end (about 10 s here), and
    an ended stream gives its admission back, so the exact claim is "never more than `limit`
    admitted at once": 200s minus the streams that had already ended. A stream counts as ended
    when its whole body reads back within a moment of the last answer (a live one is still
    decoding). A burst that saw no 503 at all is tried again, so the 503's shape is checked."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "burst"}],
        "stream": True,
        "ignore_eos": True,
    }
    limits = httpx.Limits(max_connections=limit + 16)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        # A kept session holds its generation slot and (if one was spare) its prompt snapshot.
        before = await _idle_stats(client)
        tries = 3
        for _ in range(tries):
            sent = [
                client.build_request("POST", "/v1/chat/completions", json=body)
                for _ in range(limit + 8)
            ]
            results = await asyncio.gather(*(client.send(r, stream=True) for r in sent))
            try:
                codes = [r.status_code for r in results]
                ended = await _ended(r for r in results if r.status_code == 200)
                assert set(codes) <= {200, 503}, codes
                assert codes.count(200) - ended <= limit, (codes, ended)
                for r in results:
                    if r.status_code == 503:
                        assert r.headers["retry-after"] == "1", await r.aread()
                        assert json.loads(await r.aread())["error"]["code"] == "overloaded"
            finally:
                for r in results:
                    await r.aclose()
            stats = await _idle_stats(client)
            assert stats["num_waiting"] == 0, stats
            assert _held(stats) == _held(before), (before, stats)
            if 503 in codes:
                return
        raise AssertionError(f"no burst saw a 503 in {tries} tries (the last: {ended} ended)")


async def _ended(responses: Iterable[httpx.Response], within_s: float = 1.0) -> int:
    """How many of these streams have already sent their whole body (a live one keeps
    decoding towards the context's end, seconds away)."""

    async def drained(r: httpx.Response) -> bool:
        try:
            await asyncio.wait_for(r.aread(), within_s)
        except TimeoutError:
            return False
        return True

    return sum(await asyncio.gather(*(drained(r) for r in responses)))


def _held(stats: dict) -> tuple[int, int, int]:
    """Slots, pages and sessions held outside the prefix cache (whose entries are evictable)."""
    return (
        stats["slots_used"] - stats["prefix_cache_checkpoints"],
        stats["kv_pages_used"] - stats["prefix_cache_pages"],
        stats["sessions_held"],
    )


async def _idle_stats(client: httpx.AsyncClient) -> dict:
    """The replica's stats once no request is active (the engine loop publishes every few steps)."""
    for _ in range(100):
        stats = (await client.get("/v1/internal/stats")).json()
        if stats["num_active_requests"] == 0 and stats["num_running"] == 0:
            return stats
        await asyncio.sleep(0.1)
    raise AssertionError(f"the replica did not go idle: {stats}")
