"""Structured outputs and tool calling through `serve run deployments/lfm2.yaml`, answered to
the official `openai` client. The checkpoint is the tiny random LFM2: only the grammar can make
its output valid JSON, let alone valid under the schema.

The app runs with `quantization: int8`: structured outputs and a session's resume work
unchanged on int8 weights (the fp32 path's json_schema and tool calls are in
test_serve_yaml.py and test_serve_forks.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from grammar_schemas import INVALID, SCHEMAS, UNSUPPORTED
from serve_apps import openai_client, second_turn_cached_tokens, yaml_app

pytest.importorskip("xgrammar")
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
MSGS = [{"role": "user", "content": "Answer in JSON."}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "on": {"type": "boolean"},
    },
    "required": ["hour", "on"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
PARAMS = {"get_weather": WEATHER, "set_alarm": ALARM}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with yaml_app("lfm2", tmp_path_factory, quantization="int8") as url:
        yield url


def test_the_weights_are_int8_and_a_session_resumes(base: str, model: str) -> None:
    startup = httpx.get(f"{base}/v1/internal/stats", timeout=30).json()["startup"]
    assert "quantize" in dict(startup["phases"]) and startup["weight_bytes"]["int8"] > 0
    assert second_turn_cached_tokens(openai_client(base), model, "int8-session") > 0


def fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def check(text: str | None, schema: dict[str, Any]) -> Any:
    value = json.loads(text or "")
    jsonschema.validate(value, schema, format_checker=FORMATS)
    return value


async def _gather(base: str, model: str, bodies: list[dict[str, Any]]) -> list[Any]:
    """All requests at once, so the replica batches them together."""
    aclient = openai.AsyncOpenAI(
        base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120
    )
    async with aclient:
        return await asyncio.gather(
            *(aclient.chat.completions.create(model=model, messages=MSGS, **b) for b in bodies)
        )


def test_json_schema_outputs_validate_in_one_mixed_batch(base: str, model: str) -> None:
    """Every schema, greedy and sampled, plus unconstrained requests, all in flight together:
    the constrained ones validate and the unconstrained greedy answer is what it is alone."""
    free = {"max_tokens": 16, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    alone = asyncio.run(_gather(base, model, [free]))[0].choices[0].message.content
    bodies = [
        {"response_format": fmt(s), "max_tokens": 200, "temperature": t, "seed": i}
        for i, s in enumerate(SCHEMAS.values())
        for t in (0.0, 1.0)
    ]
    replies = asyncio.run(_gather(base, model, [free, *bodies, free]))
    for reply, body in zip(replies[1:-1], bodies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        check(choice.message.content, body["response_format"]["json_schema"]["schema"])
    assert replies[0].choices[0].message.content == alone == replies[-1].choices[0].message.content


@pytest.mark.parametrize("name", ["nested-object", "array-of-objects", "string-pattern"])
def test_json_schema_streamed(client: openai.OpenAI, model: str, name: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=MSGS,  # type: ignore[arg-type]
        response_format=fmt(SCHEMAS[name]),  # type: ignore[arg-type]
        max_tokens=200,
        temperature=1.0,
        seed=7,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The text came as content deltas; how many chunks is free (a fast core coalesces them).
    assert text and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    check(text, SCHEMAS[name])


def test_json_object_and_completions(client: openai.OpenAI, model: str) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model=model,
            messages=MSGS,  # type: ignore[arg-type]
            response_format={"type": "json_object"},
            max_tokens=400,
            temperature=1.0,
            seed=seed,
        )
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    schema = SCHEMAS["array-min-max-items"]
    c = client.completions.create(
        model=model, prompt="x", max_tokens=50, extra_body={"response_format": fmt(schema)}
    )
    check(c.choices[0].text, schema)


def _tool_call(client: openai.OpenAI, model: str, choice: Any, seed: int, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,
        max_tokens=420,  # `required` is a list: a random model may call a few times
        temperature=1.0,
        seed=seed,
        **kw,
    )


def test_required_and_named_tool_calls_match_the_schemas(client: openai.OpenAI, model: str) -> None:
    named = {"type": "function", "function": {"name": "set_alarm"}}
    for seed in range(3):
        for choice in ("required", named):
            r = _tool_call(client, model, choice, seed)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
            for call in c.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                check(call.function.arguments, PARAMS[call.function.name])
            if choice is named:
                assert [t.function.name for t in c.message.tool_calls] == ["set_alarm"]
    one = _tool_call(client, model, "required", 0, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls or []) == 1


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_streamed(client: openai.OpenAI, model: str, choice: str) -> None:
    """The name first, then the arguments; the pieces of each call concatenate to the arguments
    the same request gets whole (same seed). How many pieces arrive depends on how the stream's
    chunks coalesce (a loaded machine sends fewer, larger ones), so piecewise emission itself is
    checked without a server, in test_tool_stream.py."""
    pick = (
        choice if choice == "required" else {"type": "function", "function": {"name": "set_alarm"}}
    )
    chunks = list(_tool_call(client, model, pick, 1, stream=True))
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas and chunks[-1].choices[0].finish_reason == "tool_calls"
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        if d.function.name is not None:  # type: ignore[union-attr]
            assert d.index not in names and d.id and d.id.startswith("call_")
            names[d.index] = d.function.name  # type: ignore[union-attr]
        assert d.index in names  # the name came first
        args.setdefault(d.index, []).append(d.function.arguments or "")  # type: ignore[union-attr]
    whole = _tool_call(client, model, pick, 1).choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in whole] == [
        (names[i], "".join(args[i])) for i in sorted(names)
    ]
    for i in names:
        check("".join(args[i]), PARAMS[names[i]])


def test_multi_turn_with_a_tool_message(client: openai.OpenAI, model: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = _tool_call(client, model, named, 3).choices[0].message
    call = first.tool_calls[0]  # type: ignore[index]
    history = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 4}'},
    ]
    second = client.chat.completions.create(
        model=model,
        messages=history,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0.0,
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None and second.usage.prompt_tokens > 40  # tools + history


def _bad_requests() -> dict[str, tuple[dict[str, Any], str]]:
    chat = {"messages": MSGS, "max_tokens": 4}
    tool = TOOLS[0]["function"]
    bad: dict[str, tuple[dict[str, Any], str]] = {}
    for name, (schema, where) in {**UNSUPPORTED, **INVALID}.items():
        bad[f"schema-{name}"] = (
            {**chat, "response_format": fmt(schema)},
            f"response_format.json_schema.schema.{where}",
        )
    bad["tool-parameters-unsupported"] = (
        {
            **chat,
            "tools": [
                {"type": "function", "function": {**tool, "parameters": UNSUPPORTED["not"][0]}}
            ],
        },
        "tools.0.function.parameters.properties.a.not",
    )
    bad["tool-parameters-not-a-schema"] = (
        {**chat, "tools": [{"type": "function", "function": {**tool, "parameters": {"type": 3}}}]},
        "tools.0.function.parameters.type",
    )
    bad["tool-without-function"] = ({**chat, "tools": [{"type": "function"}]}, "tools.0.function")
    bad["unknown-named-tool"] = (
        {**chat, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    )
    bad["uncompilable-pattern"] = (
        {**chat, "response_format": fmt({"type": "string", "pattern": "(?<=a)b"})},
        "response_format",
    )
    bad["json-schema-missing"] = (
        {**chat, "response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    )
    bad["bad-history-arguments"] = (
        {
            **chat,
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                }
            ],
        },
        "messages.0.tool_calls.0.function.arguments",
    )
    return bad


def test_bad_schemas_and_tools_get_400_then_a_good_request_works(base: str, model: str) -> None:
    with httpx.Client(base_url=base, timeout=60) as http:
        before = http.get("/v1/internal/stats").json()
        for case, (body, where) in _bad_requests().items():
            r = http.post("/v1/chat/completions", json={"model": model, **body})
            assert r.status_code == 400, (case, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == where, (case, err)
            good = {
                "model": model,
                **body,
                "max_tokens": 60,
                "response_format": fmt(SCHEMAS["enum"]),
            }
            good.pop("tools", None), good.pop("tool_choice", None), good.update(messages=MSGS)
            ok = http.post("/v1/chat/completions", json=good)
            assert ok.status_code == 200, (case, ok.text)
            check(ok.json()["choices"][0]["message"]["content"], SCHEMAS["enum"])
        stats = http.get("/v1/internal/stats").json()
        assert _held(stats) == _held(before)
        assert stats["num_running"] == stats["num_waiting"] == 0


def _held(stats: dict[str, Any]) -> tuple[int, int]:
    """Slots and KV pages held outside a prefix cache (which keeps what requests leave)."""
    slots = stats["slots_used"] - stats.get("prefix_cache_checkpoints", 0)
    return slots, stats["kv_pages_used"] - stats.get("prefix_cache_pages", 0)
