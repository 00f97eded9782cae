"""The Responses API in one process: the ingress app over an OpenAIReplica running the real
engine on a tiny random LFM2 checkpoint (no Ray), driven with the official `openai` client.

Shapes (the client parses them), bad input (400 / 404 naming the field), the store's TTL and
bound, and a conversation by `previous_response_id` resuming from kept state. The same things
through `serve run` on 2 replicas: test_serve_responses.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response
from starlette.testclient import TestClient

from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.openai.api import ApiConfig, OpenAIReplica
from deployments.frontend.responses.store import ResponseStore
from deployments.serve.app import parse_args
from deployments.serve.ingress import IngressConfig, build_ingress_app
from deployments.serve.server import build_engine
from shortconv.tiny.checkpoint import make_tiny_checkpoint

MODEL = "tiny-lfm2"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


class _Local:
    """The engine loop on a thread of its own, the replica's calls run on it."""

    def __init__(self, ckpt: Path) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        args = parse_args({"model": str(ckpt), "max_num_seqs": 4, "num_state_slots": 16})
        engine = build_engine(args)

        async def start() -> OpenAIReplica:
            eng = AsyncEngine(engine, admission_limit=8)
            eng.start()
            return OpenAIReplica(eng, ApiConfig(MODEL, "local"))

        self.replica = asyncio.run_coroutine_threadsafe(start(), self.loop).result()


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> _Local:
    return _Local(make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("ckpt"), seed=0))


@pytest.fixture(scope="module")
def client(local: _Local) -> Iterator[openai.OpenAI]:
    app = build_ingress_app(lambda sid: local.replica, IngressConfig(MODEL))
    with TestClient(app) as http:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
        )


def test_text_response_parses_and_is_stored(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=5,
        temperature=0.0,
    )  # fmt: skip
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage and r.usage.output_tokens == 5 and r.usage.input_tokens > 0
    assert r.output[0].type == "message" and r.output_text
    Response.model_validate(r.model_dump())  # strictly the client's type, not just parsed
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text


def test_streamed_text_equals_the_whole_one(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, input="Count", max_output_tokens=6, temperature=0.0)
    whole = client.responses.create(**kw, store=False)
    events = list(client.responses.create(**kw, store=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}
    r = client.responses.create(
        model=MODEL,
        input="A point",
        text={"format": fmt},
        temperature=0.0,  # type: ignore[arg-type]
    )
    assert r.status == "completed"
    point = json.loads(r.output_text)
    assert set(point) == {"x", "y"} and all(isinstance(v, int) for v in point.values())
    with client.responses.stream(
        model=MODEL,
        input="A point",
        text={"format": fmt},
        temperature=0.0,  # type: ignore[arg-type]
    ) as stream:
        final = stream.get_final_response()
    assert final.output_text == r.output_text


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL, tools=[WEATHER], temperature=0.0, parallel_tool_calls=False
    )
    r = client.responses.create(
        **kw, input="Weather in Paris?", tool_choice="required", max_output_tokens=400
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather"
    assert "city" in json.loads(calls[0].arguments)
    Response.model_validate(r.model_dump())
    with client.responses.stream(
        **kw, input="Weather in Paris?", tool_choice="required", max_output_tokens=400
    ) as stream:
        arg_deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert "".join(arg_deltas) == streamed[0].arguments == calls[0].arguments
    out = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}
    nxt = client.responses.create(
        **kw,
        previous_response_id=r.id,
        input=[out],
        max_output_tokens=4,  # type: ignore[list-item]
    )
    assert nxt.output_text and nxt.previous_response_id == r.id
    assert nxt.usage and nxt.usage.input_tokens_details.cached_tokens > 0


def test_previous_response_id_resumes_from_kept_state(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, temperature=0.0, max_output_tokens=4)
    history: list[dict[str, Any]] = []
    prev = None
    for turn in range(3):
        text = f"turn {turn}: tell me more"
        r = client.responses.create(**kw, input=text, previous_response_id=prev)
        history += [{"role": "user", "content": text}]
        full = client.responses.create(**kw, input=history, store=False)  # type: ignore[arg-type]
        assert r.output_text == full.output_text
        cached = r.usage.input_tokens_details.cached_tokens if r.usage else 0
        assert (cached > 0) == (turn > 0)
        history += [{"role": "assistant", "content": r.output_text}]
        prev = r.id


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [{"type": "image_generation_call"}]}, 400, "input.0.type"),
        ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
         400, "input.0.content.0.image_url"),
        ({"input": [{"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
         400, "input.0.content.0.image_url"),  # a text-only model takes no images
        ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"input": "hi", "max_output_tokns": 3}, 400, "max_output_tokns"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text.format"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], status: int, param: str
) -> None:
    r = client._client.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_get_and_delete(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(r.id)
    assert info.value.body["code"] == "response_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_store_ttl_and_bound() -> None:
    now = [0.0]
    store = ResponseStore(ttl_s=10.0, max_entries=2, clock=lambda: now[0])
    for rid in ("a", "b", "c"):
        store.put({"id": rid}, [], rid)
    assert len(store) == 2 and store.get("c").session_id == "c"
    with pytest.raises(Exception, match="was not found"):
        store.get("a")  # past the bound
    now[0] = 10.0
    with pytest.raises(Exception, match="expired") as info:
        store.get("b", param="previous_response_id")
    assert info.value.status == 404 and info.value.param == "previous_response_id"  # type: ignore[attr-defined]


def test_expired_ids_are_a_404_saying_so(local: _Local) -> None:
    cfg = IngressConfig(MODEL, responses_ttl_s=0.5)
    with TestClient(build_ingress_app(lambda sid: local.replica, cfg)) as http:
        r = http.post("/v1/responses", json={"input": "x", "max_output_tokens": 2})
        rid = r.json()["id"]
        assert http.get(f"/v1/responses/{rid}").status_code == 200
        time.sleep(0.6)
        got = http.get(f"/v1/responses/{rid}")
        assert got.status_code == 404 and "expired" in got.json()["error"]["message"]
        nxt = http.post("/v1/responses", json={"input": "y", "previous_response_id": rid})
        err = nxt.json()["error"]
        assert nxt.status_code == 404 and err["param"] == "previous_response_id"
        assert "expired" in err["message"]
