"""Tool-call parsers, one per model family: the model's own call syntax -> OpenAI tool calls.

A parser is picked from the chat template (the template is what teaches the model the syntax):
LFM2's `<|tool_call_start|>[f(a=1)]<|tool_call_end|>` (a Python-style call list) and ZAYA1's
`<zyphra_tool_call><function=f><parameter=a>1</parameter></function></zyphra_tool_call>` (or a
JSON `{"name", "arguments"}` body). Text that does not parse is returned as content, whole: a
malformed call is never half-turned into a call.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any


class ToolParseError(ValueError):
    pass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)


@dataclass(frozen=True)
class Parsed:
    content: str  # the text outside the call blocks
    calls: tuple[ParsedCall, ...]


class BaseToolParser:
    """Splits text into content and call blocks between `start` and `end`."""

    family = ""
    start = ""
    end = ""

    def parse(self, text: str, schemas: dict[str, dict[str, Any]] | None = None) -> Parsed:
        """`schemas` (tool name -> parameters) lets a parser type untyped argument text."""
        if self.start not in text:
            return Parsed(text, ())
        content, calls, rest = [], [], text
        try:
            while self.start in rest:
                before, _, after = rest.partition(self.start)
                body, found, rest = after.partition(self.end)
                if not found:
                    raise ToolParseError("a tool-call block is not closed")
                content.append(before)
                calls += self.parse_block(body, schemas or {})
        except (ToolParseError, SyntaxError, ValueError, RecursionError):
            return Parsed(text, ())
        content.append(rest)
        return Parsed("".join(content), tuple(calls))

    def parse_block(self, body: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedCall]:
        raise NotImplementedError


def _json_args(args: Any) -> str:
    if not isinstance(args, dict):
        raise ToolParseError("tool-call arguments must be an object")
    return json.dumps(args, ensure_ascii=False)


_PY_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False}
_PY_NAMES["null"] = None


def _py_value(node: ast.expr) -> Any:
    """A literal argument value (Python literals, and JSON's true/false/null as LFM2 may write)."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, complex)):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ToolParseError("** in a tool-call argument")
        keys = [_py_value(k) for k in node.keys]  # type: ignore[arg-type]
        if not all(isinstance(k, str) for k in keys):
            raise ToolParseError("object keys must be strings")
        return dict(zip(keys, (_py_value(v) for v in node.values), strict=True))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _py_value(node.operand)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ToolParseError("sign on a non-number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Name) and node.id in _PY_NAMES:
        return _PY_NAMES[node.id]
    raise ToolParseError(f"not a literal: {ast.dump(node)[:80]}")


class Lfm2ToolParser(BaseToolParser):
    family = "lfm2"
    start, end = "<|tool_call_start|>", "<|tool_call_end|>"

    def parse_block(self, body: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedCall]:
        tree = ast.parse(body.strip(), mode="eval").body
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for node in nodes:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                raise ToolParseError("expected name(arg=value, ...)")
            if node.args or any(k.arg is None for k in node.keywords):
                raise ToolParseError("tool-call arguments must be keyword arguments")
            args = {k.arg: _py_value(k.value) for k in node.keywords}
            calls.append(ParsedCall(node.func.id, _json_args(args)))
        if not calls:
            raise ToolParseError("an empty tool-call list")
        return calls


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


class ZayaToolParser(BaseToolParser):
    family = "zaya1"
    start, end = "<zyphra_tool_call>", "</zyphra_tool_call>"

    def parse_block(self, body: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedCall]:
        body = body.strip()
        if body.startswith("{"):
            obj = json.loads(body)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ToolParseError("a JSON tool call needs a string name")
            args = obj.get("arguments", {})
            return [
                ParsedCall(
                    obj["name"], _json_args(json.loads(args) if isinstance(args, str) else args)
                )
            ]
        fns = list(_FUNCTION.finditer(body))
        if not fns or _FUNCTION.sub("", body).strip():
            raise ToolParseError("expected <function=name>...</function>")
        calls = []
        for fn in fns:
            name, inner = fn.group(1), fn.group(2)
            props = (schemas.get(name) or {}).get("properties") or {}
            params = list(_PARAMETER.finditer(inner))
            if _PARAMETER.sub("", inner).strip():
                raise ToolParseError("text between parameters")
            args = {p.group(1): _xml_value(p.group(2), props.get(p.group(1))) for p in params}
            calls.append(ParsedCall(name, _json_args(args)))
        return calls


def _xml_value(raw: str, schema: Any) -> Any:
    """A parameter's text: kept as a string where the tool's schema says string, else JSON when
    it parses as JSON (numbers, booleans, objects), else the text."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


PARSERS: tuple[type[BaseToolParser], ...] = (Lfm2ToolParser, ZayaToolParser)


def parser_for_template(template: str | None) -> BaseToolParser | None:
    """The parser whose call markers the chat template writes, or None (no tool format)."""
    for cls in PARSERS:
        if template and cls.start in template:
            return cls()
    return None
