"""The Responses API through `serve run deployments/lfm2.yaml` on 2 replicas (one app for the
module), with the official `openai` client and the OpenAI Agents SDK.

Prefix caching is off, so a request without a session prefills its whole prompt: every cached
token a turn reports came from its conversation's kept session state, on the replica that owns
it. Conversations by `previous_response_id` must land on their owner each turn, resume there
(cached_tokens covering the earlier turns), and answer exactly what the same conversation sent
whole (store=false: no session, full prefill) gets.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from serve_apps import yaml_app
from test_responses_local import POINT, WEATHER

REPLICA_HEADER = "x-shortconv-replica"
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_output_tokens": 5}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # NOTE: 64 state slots: every stored response's conversation pins its session's
    # checkpoints (session_ttl_s), and this module starts a few dozen.
    args = dict(min_replicas=2, max_replicas=2, replica_num_cpus=0.5, max_num_seqs=8)
    args.update(num_state_slots=64)
    with yaml_app("lfm2", tmp_path_factory, enable_prefix_caching=False, **args) as url:
        yield url


def test_text_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    whole = client.responses.create(model=model, input="Hello", store=False, **GREEDY)
    assert whole.status == "incomplete" and whole.output_text and whole.usage
    assert whole.usage.output_tokens == GREEDY["max_output_tokens"]
    events = list(client.responses.create(model=model, input="Hello", stream=True, **GREEDY))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(deltas) == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_json_schema_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    text: Any = {"format": {"type": "json_schema", "name": "point", "schema": POINT}}
    kw: dict[str, Any] = dict(model=model, input="A point", text=text, temperature=0.0)
    r = client.responses.create(**kw)
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"x", "y"}
    with client.responses.stream(**kw) as stream:
        assert stream.get_final_response().output_text == r.output_text


def test_function_call_round_trip_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = dict(
        model=model, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        temperature=0.0, max_output_tokens=400,
    )  # fmt: skip
    r = client.responses.create(**kw, input="Weather in Paris?")
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    with client.responses.stream(**kw, input="Weather in Paris?") as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (streamed,) = [o for o in final.output if o.type == "function_call"]
    # NOTE: not a count of deltas: when the engine core runs ahead of the replica's relay, a
    # stream's tokens arrive coalesced, and the whole arguments may come as one delta.
    assert deltas and "".join(deltas) == streamed.arguments == call.arguments
    answer: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    for stream_it in (False, True):
        kw2 = dict(model=model, tools=[WEATHER], previous_response_id=r.id, **GREEDY)
        if stream_it:
            with client.responses.stream(**kw2, input=answer) as s:
                events = list(s)
            nxt = events[-1].response  # response.incomplete: the stream helper wants completed
        else:
            nxt = client.responses.create(**kw2, input=answer)
        assert nxt.output_text and nxt.previous_response_id == r.id


def _turn(client: openai.OpenAI, model: str, prev: str | None, text: str) -> dict[str, Any]:
    raw = client.responses.with_raw_response.create(
        model=model, input=text, previous_response_id=prev, **GREEDY
    )
    r = raw.parse()
    assert r.usage is not None
    return {
        "id": r.id,
        "text": r.output_text,
        "input_tokens": r.usage.input_tokens,
        "cached": r.usage.input_tokens_details.cached_tokens,
        "replica": raw.headers[REPLICA_HEADER],
    }


def _conversation(client: openai.OpenAI, model: str, n: int) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    history: list[dict[str, str]] = []
    for k in range(3):
        text = f"conversation {n}, turn {k}: tell me more."
        turn = _turn(client, model, turns[-1]["id"] if turns else None, text)
        history.append({"role": "user", "content": text})
        whole: Any = client.responses.create(model=model, input=history, store=False, **GREEDY)
        turn.update(
            want=whole.output_text, whole_cached=whole.usage.input_tokens_details.cached_tokens
        )
        history.append({"role": "assistant", "content": turn["text"]})
        turns.append(turn)
    return turns


def test_three_turns_by_previous_response_id_stay_on_their_owner(
    client: openai.OpenAI, model: str
) -> None:
    with ThreadPoolExecutor(4) as pool:  # concurrent: the conversations spread over both
        convs = list(pool.map(lambda n: _conversation(client, model, n), range(4)))
    for turns in convs:
        first, *later = turns
        assert first["cached"] == 0
        for prev, turn in zip(turns, later, strict=False):
            assert turn["replica"] == first["replica"]  # the owner, every turn
            # the earlier turns' prompt (at least) came from kept state
            assert turn["cached"] >= prev["input_tokens"], (prev, turn)
        for turn in turns:
            assert turn["text"] == turn["want"] and turn["whole_cached"] == 0
    owners = {turns[0]["replica"] for turns in convs}
    print(f"conversation owners: {owners}")


def test_get_delete_and_unknown_ids(client: openai.OpenAI, model: str, base: str) -> None:
    r = client.responses.create(model=model, input="keep me", **GREEDY)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=model, input="x", previous_response_id=r.id)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    bad = {"model": model, "input": [{"type": "computer_call_output", "call_id": "c"}]}
    got = httpx.post(f"{base}/v1/responses", json=bad, timeout=60)
    assert got.status_code == 400 and got.json()["error"]["param"] == "input.0.type"


def test_agents_sdk_runs_a_tool_round_trip(base: str, model: str) -> None:
    """An OpenAI Agents SDK agent with one function tool, on the Responses API.

    A tiny random model never chooses a tool by itself, so the first turn forces it
    (`tool_choice="required"`: the grammar makes it call `get_weather` with schema-valid
    arguments); the SDK runs the tool, sends its output back as a `function_call_output`
    item, and (its `reset_tool_choice` default) lets the model answer freely next. A random
    model never stops by itself either, and the SDK takes an `incomplete` response as a
    failure, so the agent has an `output_type`: its JSON schema (`text.format`) ends that
    answer, which ends the run. Greedy, so the run is the same every time."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from pydantic import BaseModel

    class Weather(BaseModel):
        sunny: bool

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny"

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model=model, openai_client=client),
            output_type=Weather,
            model_settings=ModelSettings(
                tool_choice="required", temperature=0.0, max_tokens=300,
                parallel_tool_calls=False,
            ),
        )  # fmt: skip
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=3)

    result = asyncio.run(run())
    assert len(cities) == 1  # the tool ran once
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, Weather)


@pytest.mark.parametrize("stream", [False, True])
def test_guidellm_responses_bodies(base: str, model: str, stream: bool) -> None:
    """What guidellm 0.8.1's `/v1/responses` handler sends for a fixed output length
    (guidellm/backends/openai/request_handlers.py): vLLM's `stop: null` and `ignore_eos`, the
    prompt as `input_text` parts of a role-only item; usage from the terminal event."""
    body: dict[str, Any] = {
        "model": model,
        "max_output_tokens": 8,
        "stop": None,
        "ignore_eos": True,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "the sky is"}]}],
    }
    if stream:
        body["stream"] = True
    r = httpx.post(f"{base}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        done = json.loads(lines[-1][len("data: ") :])
        assert done["type"] == "response.incomplete"
        r_body = done["response"]
    else:
        r_body = r.json()
    assert r_body["usage"]["output_tokens"] == 8 and r_body["status"] == "incomplete"
