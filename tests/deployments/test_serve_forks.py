"""OpenAI's `n` through `serve run deployments/lfm2.yaml` (one app for the module) with the
official `openai` client and raw SSE: choices, interleaved streams, usage, completions batches
times n, seeds, the configured maximum, and slots and pages given back after a disconnect."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from serve_apps import openai_client, yaml_app

MAX_N = 6
SEATS = 4  # max_num_seqs: a request with more forks has some of them wait for a seat
MESSAGES = [{"role": "user", "content": "Name three colours."}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@dataclass(frozen=True)
class Service:
    client: openai.OpenAI
    http: httpx.Client
    model: str


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    args = {"max_replicas": 1, "max_n": MAX_N, "max_num_seqs": SEATS}
    with yaml_app("lfm2", tmp_path_factory, **args) as url:
        with httpx.Client(base_url=url, timeout=120) as http:
            client = openai_client(url)
            yield Service(client, http, client.models.list().data[0].id)


def held(http: httpx.Client) -> tuple[int, int, int]:
    """Slots and KV pages held outside the prefix cache (which keeps what requests leave), and
    the requests still running or waiting."""
    s = http.get("/v1/internal/stats").json()
    slots = s["slots_used"] - s.get("prefix_cache_checkpoints", 0)
    pages = s["kv_pages_used"] - s.get("prefix_cache_pages", 0)
    return slots, pages, s["num_running"] + s["num_waiting"]


def wait_idle(http: httpx.Client, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while held(http) != (0, 0, 0):
        assert time.monotonic() < deadline, held(http)
        time.sleep(0.2)


def test_n3_chat_whole_and_streamed(svc: Service) -> None:
    client, model = svc.client, svc.model
    one = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    three = client.chat.completions.create(model=model, messages=MESSAGES, n=3, **GREEDY)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert texts == [one.choices[0].message.content] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, n=3, stream=True, stream_options={"include_usage": True},
        **GREEDY,
    )  # fmt: skip
    order: list[int] = []
    streamed = ["", "", ""]
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            order.append(c.index)
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    # Interleaved: some choice's chunk comes between two chunks of another one.
    assert order != sorted(order)
    assert usage is not None and usage.completion_tokens == three.usage.completion_tokens
    assert usage.prompt_tokens == one.usage.prompt_tokens


def test_completions_prompts_times_n_with_logprobs(svc: Service) -> None:
    client, model = svc.client, svc.model
    prompts = ["The sky is", "Once upon a time"]
    kw: dict[str, Any] = {**GREEDY, "logprobs": 2}
    alone = [client.completions.create(model=model, prompt=p, **kw) for p in prompts]
    batch = client.completions.create(model=model, prompt=prompts, n=2, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # prompt_index * n + fork_index
    want = [a.choices[0].text for a in alone for _ in range(2)]
    assert [c.text for c in batch.choices] == want
    for c, a in zip(batch.choices, [a for a in alone for _ in range(2)], strict=True):
        assert c.logprobs.tokens == a.choices[0].logprobs.tokens
        assert len(c.logprobs.top_logprobs) == 8
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 4 * 8


def test_seeded_choices_differ_and_reproduce(svc: Service) -> None:
    client, model = svc.client, svc.model
    kw: dict[str, Any] = {"temperature": 1.0, "seed": 7, "max_tokens": 8, "n": 4}
    kw["extra_body"] = {"ignore_eos": True}
    first = client.completions.create(model=model, prompt="Hello", **kw)
    again = client.completions.create(model=model, prompt="Hello", **kw)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) == 4


def test_n2_required_tool_calls_each_match_the_schema(svc: Service) -> None:
    """`tool_choice="required"` with n=2: each choice's grammar (a matcher per fork) makes its
    own schema-valid call; the two diverge under one seed and reproduce with it."""
    pytest.importorskip("xgrammar")
    kw: dict[str, Any] = {
        "model": svc.model,
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": 3,
        "n": 2,
    }
    first = svc.client.chat.completions.create(**kw)
    calls = []
    for c in first.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls or []) == 1, c
        call = c.message.tool_calls[0].function  # type: ignore[index]
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), CITY)
        calls.append(call.arguments)
    assert calls[0] != calls[1]
    again = svc.client.chat.completions.create(**kw)
    assert [c.message.tool_calls[0].function.arguments for c in again.choices] == calls  # type: ignore[index]
    wait_idle(svc.http)


def test_forks_wait_for_seats(svc: Service) -> None:
    client, http, model = svc.client, svc.http, svc.model
    one = client.completions.create(model=model, prompt="Hi", **GREEDY)
    many = client.completions.create(model=model, prompt="Hi", n=MAX_N, **GREEDY)  # > SEATS
    assert [c.text for c in many.choices] == [one.choices[0].text] * MAX_N
    wait_idle(http)


def test_n_above_the_maximum_is_a_400_naming_n(svc: Service) -> None:
    client, model = svc.client, svc.model
    for call in (
        lambda: client.completions.create(model=model, prompt="Hi", n=MAX_N + 1),
        lambda: client.chat.completions.create(model=model, messages=MESSAGES, n=MAX_N + 1),
    ):
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert exc.value.body["param"] == "n"  # type: ignore[index]


def test_a_disconnect_mid_stream_frees_every_fork(svc: Service) -> None:
    """n=5 with 4 seats: 4 forks decode and 1 waits when the client goes away; every one of
    them is aborted (none completed) and every slot and page comes back."""
    http, model = svc.http, svc.model
    wait_idle(http)
    aborted = http.get("/v1/internal/stats").json()["finished_by_reason"].get("abort", 0)
    body = {"model": model, "prompt": "Tell me a long story", "n": 5, "stream": True}
    body.update(max_tokens=1000, temperature=1.0, ignore_eos=True)
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) >= 2:
                break  # leaving the block closes the connection: the disconnect under test
    wait_idle(http)
    after = http.get("/v1/internal/stats").json()["finished_by_reason"].get("abort", 0)
    assert after - aborted == 5
