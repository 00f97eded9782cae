"""Speculative decoding through `serve run deployments/lfm2.yaml` (`speculative_config` in the
app's args, as the YAML and the Helm values carry it): a session's second turn resumes its kept
state and a json_schema answer is grammar-bound, each equal to the same app without
speculation. One app at a time: the module serves the app without speculation, records its
answers, stops it, then serves it with speculation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from grammar_schemas import SCHEMAS
from serve_apps import openai_client, yaml_app

pytest.importorskip("xgrammar")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
SCHEMA = SCHEMAS["nested-object"]
FORMAT = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA, "strict": True}}


def answers(base: str) -> dict[str, Any]:
    """Two greedy turns of one session, a json_schema answer, and the engine's stats."""
    client = openai_client(base)
    model = client.models.list().data[0].id
    ask = {"model": model, "max_tokens": 24, "temperature": 0.0}
    session = {"x-session-id": "spec"}
    turn: list[Any] = [{"role": "user", "content": "Remember me, remember me."}]
    first = client.chat.completions.create(messages=turn, extra_headers=session, **ask)
    turn += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And now?"},
    ]
    second = client.chat.completions.create(messages=turn, extra_headers=session, **ask)
    details = second.usage.prompt_tokens_details if second.usage else None
    structured = client.chat.completions.create(
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format=FORMAT,
        **(ask | {"max_tokens": 64}),  # room for the whole object: it must parse
    )
    return {
        "turns": [c.choices[0].message.content for c in (first, second)],
        "cached": details.cached_tokens if details else None,
        "json": structured.choices[0].message.content,
        "stats": httpx.get(f"{base}/v1/internal/stats", timeout=30).json(),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    found = {}
    for name, spec in (("off", None), ("on", NGRAM)):
        with yaml_app("lfm2", tmp_path_factory, speculative_config=spec) as url:
            found[name] = answers(url)
    yield found


def test_the_app_speculated(runs: dict[str, dict[str, Any]]) -> None:
    on, off = runs["on"]["stats"], runs["off"]["stats"]
    assert on["spec_decode_num_draft_tokens"] > 0, on
    assert off["spec_decode_num_draft_tokens"] == 0


def test_a_sessions_second_turn_resumes_and_equals_no_speculation(
    runs: dict[str, dict[str, Any]],
) -> None:
    on, off = runs["on"], runs["off"]
    assert on["turns"] == off["turns"]
    assert on["cached"] == off["cached"] and on["cached"] > 0


def test_json_schema_equals_no_speculation(runs: dict[str, dict[str, Any]]) -> None:
    on, off = runs["on"]["json"], runs["off"]["json"]
    assert on == off
    jsonschema.validate(json.loads(on), SCHEMA)
