"""Tool calls read from output that is still being decoded, so their arguments can stream.

Two readers. A forced choice (`required`, a named function) decodes JSON under a grammar:
`scan_forced` finds each call's name and the raw text span of its arguments object, open or
closed, so the arguments stream as the model writes them and the finished text is the same span.
`auto` decodes the model's own call syntax: `partial_calls` closes the unfinished block (open
strings, brackets, tags), parses it with the family parser, and keeps the part of each call's
JSON arguments that cannot change any more (`stable_prefix`): what is streamed is always a
prefix of what the finished parse returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deployments.frontend.tools.parsers import (
    BaseToolParser,
    Lfm2ToolParser,
    ToolParseError,
    ZayaToolParser,
)

_SCALAR_TAIL = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.+-"


@dataclass
class RawCall:
    """A forced call as decoded so far: its name once the string is closed; its arguments'
    span in the text (end None while the object is still open)."""

    name: str | None = None
    start: int | None = None
    end: int | None = None

    def arguments(self, text: str) -> str:
        if self.start is None:
            return ""
        return text[self.start : self.end if self.end is not None else len(text)]


def scan_forced(text: str, named: str | None) -> list[RawCall]:
    """The calls in a forced output so far: for a named function the text is the arguments
    object itself; for `required`, a list of {"name": ..., "arguments": {...}} objects."""
    if named is not None:
        start = text.find("{")
        if start < 0:
            return [RawCall(named)]
        return [RawCall(named, start, _object_end(text, start))]
    return _scan_call_list(text)


def _object_end(text: str, start: int) -> int | None:
    """The index past the object opening at `start`, or None while it is open."""
    depth, in_str, esc = 0, False, False
    for pos in range(start, len(text)):
        ch = text[pos]
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return pos + 1
    return None


def _scan_call_list(text: str) -> list[RawCall]:
    calls: list[RawCall] = []
    depth, in_str, esc, str_start = 0, False, False, 0
    key, expect_value = None, False
    for pos, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 2 and calls:
                    value = json.loads(text[str_start : pos + 1])
                    if not expect_value:
                        key = value
                    elif key == "name":
                        calls[-1].name = value
            continue
        if ch == '"':
            in_str, str_start = True, pos
        elif ch in "[{":
            if depth == 1 and ch == "{":
                calls.append(RawCall())
                expect_value = False
            elif depth == 2 and calls and key == "arguments" and expect_value:
                calls[-1].start = pos
            depth += 1
        elif ch in "]}":
            depth -= 1
            last = calls[-1] if calls else None
            if depth == 2 and last is not None and last.start is not None and last.end is None:
                last.end = pos + 1
        elif depth == 2 and ch in ":,":
            expect_value = ch == ":"
    return calls


def stable_prefix(arguments: str) -> str:
    """The part of a partial call's JSON arguments that the finished call will begin with:
    without the closers the completion added, and without a trailing number or literal (which
    may still grow: 12 -> 125, tr -> true); an open string keeps its text."""
    s = arguments.rstrip("}] ")
    if s.endswith('"'):
        return s[:-1]
    return s.rstrip(_SCALAR_TAIL)


def partial_calls(
    parser: BaseToolParser, text: str, schemas: dict[str, dict[str, Any]]
) -> list[tuple[str, str]]:
    """(name, stable arguments prefix) of every call in the output so far, closed blocks and
    the open one; [] while the open block does not parse yet."""
    calls: list[tuple[str, str]] = []
    rest = text
    while parser.start in rest:
        _, _, after = rest.partition(parser.start)
        body, closed, rest = after.partition(parser.end)
        try:
            if closed:
                calls += [(c.name, c.arguments) for c in parser.parse_block(body, schemas)]
                continue
            completed = _close(parser, body, schemas)
            if completed is None:
                return calls
            found = parser.parse_block(completed, schemas)
        except (ToolParseError, SyntaxError, ValueError, RecursionError):
            return calls
        return calls + [(c.name, stable_prefix(c.arguments)) for c in found]
    return calls


def _close(parser: BaseToolParser, body: str, schemas: dict[str, dict[str, Any]]) -> str | None:
    if isinstance(parser, Lfm2ToolParser):
        return _close_python(body)
    if isinstance(parser, ZayaToolParser):
        return _close_xml(body, schemas)
    return None


def _close_python(body: str) -> str | None:
    """A partial `[f(a="x", b=[1, 2` closed: open string, then brackets, in reverse."""
    stack: list[str] = []
    quote, esc = "", False
    pairs = {"(": ")", "[": "]", "{": "}"}
    for ch in body:
        if quote:
            esc, quote = (False, quote) if esc else (ch == "\\", "" if ch == quote else quote)
        elif ch in "\"'":
            quote = ch
        elif ch in pairs:
            stack.append(pairs[ch])
        elif ch in ")]}":
            if not stack or stack.pop() != ch:
                return None
    if esc:
        body = body[:-1]  # a lone backslash would escape the closing quote
    if "(" not in body:
        return None  # no call has its name yet
    return body + quote + "".join(reversed(stack))


_PARAM_END = "</parameter>"


def _close_xml(body: str, schemas: dict[str, dict[str, Any]]) -> str | None:
    """A partial `<function=f><parameter=a>tex` closed. Only a string parameter's open value
    is kept (other types may change meaning as they grow: `[1, 2` is text, `[1, 2]` a list),
    without a tail that may begin its closing tag."""
    at = body.rfind("<function=")
    fn_end = body.find(">", at) + 1 if at >= 0 else 0
    if fn_end <= 0:
        return None
    name = body[at + len("<function=") : fn_end - 1]
    tail = body[fn_end:]
    last = tail.rfind(_PARAM_END)
    done = tail[: last + len(_PARAM_END)] if last >= 0 else ""
    pending = tail[len(done) :]
    opened = pending.find("<parameter=")
    close = pending.find(">", opened) if opened >= 0 else -1
    if close >= 0:
        param = pending[opened + len("<parameter=") : close]
        props = (schemas.get(name) or {}).get("properties") or {}
        if (props.get(param) or {}).get("type") == "string":
            value = _without_tag_start(pending[close + 1 :])
            done += pending[: close + 1] + value + _PARAM_END
    return body[:fn_end] + done + "</function>"


def _without_tag_start(value: str) -> str:
    for k in range(min(len(_PARAM_END), len(value)), 0, -1):
        if _PARAM_END.startswith(value[-k:]):
            return value[:-k]
    return value
