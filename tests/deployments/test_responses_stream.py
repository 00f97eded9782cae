"""Chat chunks -> Responses events (deployments/frontend/responses/stream.py), checked by the
`openai` client's own event types, and input items -> chat messages (responses/convert.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from deployments.frontend.openai.errors import APIError
from deployments.frontend.responses.convert import input_messages
from deployments.frontend.responses.protocol import ResponsesRequest
from deployments.frontend.responses.stream import ResponseEvents

SKELETON = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m", "output": []}
SKELETON.update(parallel_tool_calls=True, tool_choice="auto", tools=[], status="in_progress")


def _chunk(content: str | None = None, call: dict[str, Any] | None = None, **kw: Any) -> dict:
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if call:
        delta["tool_calls"] = [call]
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": kw.get("finish")}]}


async def _collect(chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], ResponseEvents]:
    async def gen() -> AsyncIterator[dict[str, Any]]:
        for c in chunks:
            yield c

    finish = lambda items, usage, status: {
        **SKELETON,
        "output": items,
        "status": status,
        "usage": usage,
    }
    events = ResponseEvents(SKELETON, finish)
    return [e async for e in events.events(gen())], events


def test_text_then_a_call_become_two_items_in_order() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    chunks = [
        _chunk("He"),
        _chunk("llo"),
        _chunk(call={**call, "function": {"name": "f", "arguments": '{"a":'}}),
        _chunk(call={"index": 0, "function": {"arguments": " 1}"}}),
        _chunk(finish="tool_calls"),
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
    ]
    events, state = asyncio.run(_collect(chunks))
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text, fc = state.items
    assert text["content"][0]["text"] == "Hello" and fc["arguments"] == '{"a": 1}'
    assert fc["call_id"] == "call_1" and fc["status"] == "completed"
    assert state.usage["total_tokens"] == 7


def test_length_is_incomplete_and_an_error_fails() -> None:
    events, _ = asyncio.run(_collect([_chunk("a", finish="length")]))
    assert events[-1]["type"] == "response.incomplete"
    err = {"error": {"message": "boom", "code": "engine_dead"}}
    events, _ = asyncio.run(_collect([_chunk("a"), err]))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]


def test_input_items_become_chat_messages() -> None:
    req = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ]
        }
    )
    user, calls, out = input_messages(req)
    assert user == {"role": "user", "content": "hi"}
    assert [c["id"] for c in calls["tool_calls"]] == ["c1", "c2"]  # parallel: one turn
    assert out == {"role": "tool", "tool_call_id": "c1", "content": "ok"}


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "reasoning"}, "input.0.type"),
        ({"role": "robot", "content": "x"}, "input.0.role"),
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.0.call_id"),
    ],
)
def test_bad_items_name_themselves(item: dict[str, Any], param: str) -> None:
    req = ResponsesRequest.model_validate({"input": [item]})
    with pytest.raises(APIError) as info:
        input_messages(req)
    assert info.value.param == param and info.value.status == 400
