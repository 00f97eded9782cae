"""Tool-call parsers on each family's documented call strings (well-formed and malformed), their
agreement with the tiny checkpoints' templates, streaming splits and the tool checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.tools import FunctionDef, NamedToolChoice, ToolDef, plan_tools
from deployments.frontend.tools.parsers import Lfm2ToolParser, ZayaToolParser, parser_for_template
from deployments.frontend.tools.stream import ToolOutput, special_pattern
from shortconv.engine.tokenizer import Tokenizer
from shortconv.tiny.checkpoint import make_tiny_checkpoint
from shortconv.tiny.templates import LFM2_CHAT_TEMPLATE, ZAYA_CHAT_TEMPLATE

S, E = Lfm2ToolParser.start, Lfm2ToolParser.end
ZS, ZE = ZayaToolParser.start, ZayaToolParser.end


def calls(parsed) -> list[tuple[str, dict]]:  # noqa: ANN001
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


LFM2_GOOD = {
    # LFM2's model card example: one call, then text.
    "documented": (
        f'{S}[get_candidate_status(candidate_id="12345")]{E}Checking the status of 12345.',
        [("get_candidate_status", {"candidate_id": "12345"})],
        "Checking the status of 12345.",
    ),
    "two-calls-python-literals": (
        f"{S}[f(a=1, b=[1, 2.5]), g(flag=True, x=None, s='q')]{E}",
        [("f", {"a": 1, "b": [1, 2.5]}), ("g", {"flag": True, "x": None, "s": "q"})],
        "",
    ),
    "json-literals-nested": (
        f'Sure. {S}[f(ok=true, v=null, opts={{"k": -1.5, "l": [false]}})]{E}',
        [("f", {"ok": True, "v": None, "opts": {"k": -1.5, "l": [False]}})],
        "Sure. ",
    ),
    "no-arguments": (f"{S}[ping()]{E}", [("ping", {})], ""),
}
LFM2_MALFORMED = {
    "unclosed": f'{S}[f(a="x")]',
    "positional": f"{S}[f(1)]{E}",
    "not-a-call": f"{S}[1, 2]{E}",
    "syntax": f"{S}[f(a=)]{E}",
    "call-in-value": f"{S}[f(a=g())]{E}",
    "attribute": f'{S}[os.system(cmd="rm")]{E}',
    "empty-list": f"{S}[]{E}",
    "star-kwargs": f"{S}[f(**x)]{E}",
}


@pytest.mark.parametrize("case", list(LFM2_GOOD))
def test_lfm2_calls(case: str) -> None:
    text, want, content = LFM2_GOOD[case]
    parsed = Lfm2ToolParser().parse(text)
    assert calls(parsed) == want and parsed.content == content


@pytest.mark.parametrize("case", list(LFM2_MALFORMED))
def test_lfm2_malformed_calls_stay_text(case: str) -> None:
    text = LFM2_MALFORMED[case]
    parsed = Lfm2ToolParser().parse(text)
    assert parsed.calls == () and parsed.content == text


ZAYA_GOOD = {
    "xml": (
        f"Plan first.\n{ZS}\n<function=search_docs>\n<parameter=query>\nzaya cache\n</parameter>\n"
        f"<parameter=limit>\n3\n</parameter>\n</function>\n{ZE}",
        [("search_docs", {"query": "zaya cache", "limit": 3})],
        "Plan first.\n",
    ),
    "json-body": (
        f'{ZS}{{"name": "f", "arguments": {{"a": [1, "b"]}}}}{ZE} done',
        [("f", {"a": [1, "b"]})],
        " done",
    ),
    "typed-by-schema": (  # "007" stays a string where the tool says string
        f"{ZS}\n<function=lookup>\n<parameter=code>\n007\n</parameter>\n</function>\n{ZE}",
        [("lookup", {"code": "007"})],
        "",
    ),
}
ZAYA_MALFORMED = {
    "unclosed-block": f"{ZS}\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n",
    "unclosed-function": f"{ZS}\n<function=f>\n<parameter=a>\n1\n</parameter>\n{ZE}",
    "text-between-parameters": f"{ZS}<function=f>oops<parameter=a>1</parameter></function>{ZE}",
    "json-without-name": f'{ZS}{{"arguments": {{}}}}{ZE}',
    "json-arguments-not-object": f'{ZS}{{"name": "f", "arguments": [1]}}{ZE}',
}


@pytest.mark.parametrize("case", list(ZAYA_GOOD))
def test_zaya_calls(case: str) -> None:
    text, want, content = ZAYA_GOOD[case]
    schemas = {"lookup": {"type": "object", "properties": {"code": {"type": "string"}}}}
    parsed = ZayaToolParser().parse(text, schemas)
    assert calls(parsed) == want and parsed.content == content


@pytest.mark.parametrize("case", list(ZAYA_MALFORMED))
def test_zaya_malformed_calls_stay_text(case: str) -> None:
    text = ZAYA_MALFORMED[case]
    parsed = ZayaToolParser().parse(text)
    assert parsed.calls == () and parsed.content == text


def test_the_parser_is_picked_from_the_template() -> None:
    assert isinstance(parser_for_template(LFM2_CHAT_TEMPLATE), Lfm2ToolParser)
    assert isinstance(parser_for_template(ZAYA_CHAT_TEMPLATE), ZayaToolParser)
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None


@pytest.mark.parametrize("arch", ["lfm2", "zaya1"])
def test_template_and_parser_agree(arch: str, tmp_path: Path) -> None:
    """What the template writes for an assistant turn's tool_calls parses back to them, and the
    tool list and the tool result reach the prompt as the family's markers (special tokens)."""
    tok = Tokenizer.load(make_tiny_checkpoint(arch, tmp_path / arch, seed=0))
    args = {"city": "Paris", "days": 3, "metric": True, "tags": ["a", "b"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"t": 21}'},
    ]
    ids = tok.apply_chat_template(msgs, tools=[tool])
    text = tok.decode(ids, skip_special_tokens=False)
    parser = parser_for_template(tok.hf.chat_template)
    assert parser is not None
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert calls(parser.parse(turn)) == [("get_weather", args)]
    assert '{"t": 21}' in text and '"name": "get_weather"' in text
    marker_ids = tok.encode(parser.start, add_special_tokens=False)
    assert len(marker_ids) == 1 and marker_ids[0] in ids  # one special token, not its bytes


def _plan(mode: str = "auto") -> object:
    tools = [ToolDef(type="function", function=FunctionDef(name="f", parameters=None))]
    return plan_tools(tools, mode, None, Lfm2ToolParser())  # type: ignore[arg-type]


def test_auto_streams_content_up_to_the_call_marker() -> None:
    text = f'Let me check. {S}[f(a="x")]{E} Done.<|im_end|>'
    out = ToolOutput(_plan(), special_pattern(["<|im_end|>", S, E], keep=(S, E)))  # type: ignore[arg-type]
    streamed = "".join(out.push(ch) for ch in text[:-10]) + out.push("<|im_end|>")
    rest, got = out.finish("stop")
    assert streamed == "Let me check. " and rest == " Done."
    assert [(c.name, json.loads(c.arguments)) for c in got] == [("f", {"a": "x"})]


def test_auto_releases_a_marker_prefix_that_was_not_one() -> None:
    out = ToolOutput(_plan(), None)  # type: ignore[arg-type]
    assert out.push("a <|tool") == "a "
    assert out.push("s|> b") == "<|tools|> b"
    assert out.finish("stop") == ("", ())


def test_forced_output_is_held_back_and_becomes_calls() -> None:
    out = ToolOutput(_plan("required"), None)  # type: ignore[arg-type]
    assert out.push('[{"name": "f", "arguments": {}}]') == ""
    rest, got = out.finish("stop")
    assert rest == "" and [c.name for c in got] == ["f"]
    truncated = ToolOutput(_plan("required"), None)  # type: ignore[arg-type]
    truncated.push('[{"name": "f", "argu')
    assert truncated.finish("length") == ('[{"name": "f", "argu', ())


def _tools(*params: object) -> list[ToolDef]:
    return [
        ToolDef(type="function", function=FunctionDef(name=f"t{i}", parameters=p))  # type: ignore[arg-type]
        for i, p in enumerate(params)
    ]


BAD_TOOLS = {
    "not-object": (_tools({"type": "string"}), "auto", "tools.0.function.parameters"),
    "unsupported": (
        _tools({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}}),
        "auto",
        "tools.0.function.parameters.properties.a.multipleOf",
    ),
    "invalid": (_tools({"type": "object", "required": "a"}), "auto", "tools.0.function.parameters"),
    "unknown-name": (
        _tools(None),
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
    ),
    "choice-without-tools": ([], "required", "tool_choice"),
}


@pytest.mark.parametrize("case", list(BAD_TOOLS))
def test_bad_tools_are_refused_naming_the_field(case: str) -> None:
    tools, choice, where = BAD_TOOLS[case]
    with pytest.raises(APIError) as err:
        plan_tools(tools, choice, None, Lfm2ToolParser())  # type: ignore[arg-type]
    assert err.value.status == 400 and (err.value.param or "").startswith(where), err.value.param


def test_duplicate_names_and_auto_without_a_format_are_refused() -> None:
    dup = _tools(None) + _tools(None)
    with pytest.raises(APIError, match="two tools"):
        plan_tools(dup, "auto", None, Lfm2ToolParser())
    with pytest.raises(APIError, match="no tool-call format") as err:
        plan_tools(_tools(None), "auto", None, None)
    assert err.value.param == "tool_choice"
    assert plan_tools(_tools(None), "required", None, None) is not None  # a grammar needs none


def _formatter(plan: object, drop: object = None) -> object:
    from deployments.frontend.openai.format import Formatter

    return Formatter(True, "chatcmpl-t", "m", str, False, tools=plan, drop_specials=drop)  # type: ignore[arg-type]


def _acc(text: str, reason: str) -> object:
    from deployments.frontend.openai.deltas import Accumulator

    return Accumulator(text=text, finish_reason=reason)


def test_whole_answers_split_content_and_calls() -> None:
    drop = special_pattern(["<|im_end|>", S, E], keep=(S, E))
    fmt = _formatter(_plan(), drop)
    body = fmt.whole(_acc(f'Checking. {S}[f(a="x")]{E} Done.<|im_end|>', "stop"))  # type: ignore[attr-defined]
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking.  Done."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": "x"}'}
    plain = fmt.whole(_acc("just text, no call<|im_end|>", "stop"))  # type: ignore[attr-defined]
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "just text, no call"}
    assert plain["choices"][0]["finish_reason"] == "stop"
    unknown = fmt.whole(_acc(f"{S}[g()]{E}", "stop"))  # type: ignore[attr-defined]
    assert "tool_calls" not in unknown["choices"][0]["message"]  # not one of the tools


def test_response_format_and_a_forced_tool_choice_do_not_mix() -> None:
    from deployments.frontend.openai.structured import ResponseFormat
    from deployments.frontend.openai.tools import chat_grammar

    rf = ResponseFormat(type="json_object")
    with pytest.raises(APIError) as err:
        chat_grammar(rf, _plan("required"))  # type: ignore[arg-type]
    assert err.value.param == "response_format"
    grammar, param = chat_grammar(rf, _plan("auto"))  # type: ignore[arg-type]
    assert grammar is not None and grammar.kind == "json_object" and param == "response_format"
    forced, param = chat_grammar(None, _plan("required"))  # type: ignore[arg-type]
    assert forced is not None and forced.kind == "json_schema" and param == "tools"
