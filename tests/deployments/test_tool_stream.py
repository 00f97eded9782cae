"""Streamed tool calls: the name as soon as it is known, then the arguments' text as it decodes,
for both parsers (`auto`) and for forced choices (`required`, named) under a grammar; the
pieces of a call always concatenate to the arguments of the whole response."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from deployments.frontend.openai.tools import FunctionDef, NamedToolChoice, ToolDef, plan_tools
from deployments.frontend.tools.parsers import BaseToolParser, Lfm2ToolParser, ZayaToolParser
from deployments.frontend.tools.partial import scan_forced, stable_prefix
from deployments.frontend.tools.stream import CallDelta, ToolOutput

S, E = Lfm2ToolParser.start, Lfm2ToolParser.end
ZS, ZE = ZayaToolParser.start, ZayaToolParser.end
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "tags": {}},
}
TOOLS = [
    ToolDef(type="function", function=FunctionDef(name="get_weather", parameters=PARAMS)),
    ToolDef(type="function", function=FunctionDef(name="ping", parameters=None)),
]


def _plan(choice: Any, parser: BaseToolParser | None = None) -> Any:
    return plan_tools(TOOLS, choice, None, parser or Lfm2ToolParser())


def _named() -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})


def _stream(plan: Any, pieces: list[str]) -> tuple[dict[int, list[CallDelta]], Any]:
    """Push the pieces one by one; every call delta by call index, and the finished calls."""
    out = ToolOutput(plan, None)
    got: dict[int, list[CallDelta]] = {}
    for piece in pieces:
        out.push(piece)
        for d in out.stream_calls():
            got.setdefault(d.index, []).append(d)
    _, calls, tail = out.finish_stream("stop")
    for d in tail:
        got.setdefault(d.index, []).append(d)
    return got, calls


def _check(got: dict[int, list[CallDelta]], calls: Any) -> None:
    assert calls and sorted(got) == list(range(len(calls)))
    for i, call in enumerate(calls):
        first, *rest = got[i]
        assert first.name == call.name and all(d.name is None for d in rest)
        assert "".join(d.arguments for d in got[i]) == call.arguments
        json.loads(call.arguments)


def _tokens(text: str, seed: int) -> list[str]:
    """`text` cut into pieces of 1..4 characters (a tokenizer's pieces, roughly)."""
    rng, pieces, at = random.Random(seed), [], 0
    while at < len(text):
        n = rng.randint(1, 4)
        pieces.append(text[at : at + n])
        at += n
    return pieces


CASES = {
    "named": (
        "named",
        '{"city": "Oslo, Norway", "days": 3, "tags": ["a", {"b": null}]}',
    ),
    "required-two": (
        "required",
        '[{"name": "get_weather", "arguments": {"city": "Bergen \\"west\\"", "days": 12}},'
        ' {"name": "ping", "arguments": {}}]',
    ),
    "lfm2": (
        "auto",
        f'Let me look. {S}[get_weather(city="Oslo, Norway", days=12, tags=[1, 2.5, "x"]),'
        f" ping()]{E}",
    ),
    "lfm2-escapes": ("auto", f"{S}[get_weather(city='it\\'s \\\\ here', days=-3)]{E}"),
    "zaya-xml": (
        "auto-zaya",
        f"{ZS}<function=get_weather><parameter=city>\nSan Francisco, CA\n</parameter>"
        f"<parameter=days>7</parameter><parameter=tags>[1, 2]</parameter></function>{ZE}",
    ),
}


def _case_plan(mode: str) -> Any:
    if mode == "named":
        return _plan(_named())
    if mode == "auto-zaya":
        return _plan("auto", ZayaToolParser())
    return _plan(mode)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", range(6))
def test_streamed_pieces_concatenate_to_the_whole_arguments(case: str, seed: int) -> None:
    mode, text = CASES[case]
    got, calls = _stream(_case_plan(mode), _tokens(text, seed))
    _check(got, calls)
    whole = _case_plan(mode).calls(text, "stop")
    assert [(c.name, c.arguments) for c in whole.calls] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("case", ["named", "lfm2", "zaya-xml", "required-two"])
def test_the_name_comes_first_and_the_arguments_in_several_pieces(case: str) -> None:
    mode, text = CASES[case]
    out = ToolOutput(_case_plan(mode), None)
    seen: list[CallDelta] = []
    named_at = None
    for k, piece in enumerate(_tokens(text, 0)):
        out.push(piece)
        new = out.stream_calls()
        if named_at is None and new:
            named_at = len("".join(_tokens(text, 0)[: k + 1]))
        seen += new
    assert named_at is not None and named_at < len(text)  # known before the output ends
    pieces = [d for d in seen if d.index == 0 and d.arguments]
    assert len(pieces) >= 2, seen  # the arguments stream, not one piece at the end


def test_a_named_call_is_named_before_any_argument() -> None:
    out = ToolOutput(_plan(_named()), None)
    out.push(" ")
    assert out.stream_calls() == [CallDelta(0, "get_weather", "")]
    out.push('{"ci')
    assert out.stream_calls() == [CallDelta(0, None, '{"ci')]


def test_a_truncated_forced_call_sends_no_raw_text_as_content() -> None:
    out = ToolOutput(_plan("required"), None)
    out.push('[{"name": "ping", "arguments": {"x": 1')
    assert [d.name for d in out.stream_calls()] == ["ping"]
    assert out.finish_stream("length") == ("", (), [])


def test_scan_forced_finds_names_and_argument_spans() -> None:
    text = '[{"name": "a", "arguments": {"k": "}"}}, {"name": "b", "arguments": {'
    first, second = scan_forced(text, None)
    assert (first.name, first.arguments(text)) == ("a", '{"k": "}"}')
    assert (second.name, second.end, second.arguments(text)) == ("b", None, "{")


@pytest.mark.parametrize(
    ("partial", "stable"),
    [
        ('{"a": "hel"}', '{"a": "hel'),
        ('{"a": 12}', '{"a": '),
        ('{"a": [1, 2]}', '{"a": [1, '),
        ('{"a": true}', '{"a": '),
        ("{}", "{"),
    ],
)
def test_stable_prefix_withholds_what_may_still_change(partial: str, stable: str) -> None:
    assert stable_prefix(partial) == stable
