"""`tools` / `tool_choice` at the HTTP edge: request models, checks (400 naming the field), the
grammar a forced choice decodes under, and the model's output turned into OpenAI tool calls.

`auto`: the model writes calls in its family's own syntax (the chat template teaches it) and the
family parser (deployments/frontend/tools/parsers.py) extracts them. `required` and a named function
are enforced by a grammar instead, so the arguments always match the tool's `parameters` schema:
the model writes JSON — the arguments object itself for a named function, a list
`[{"name": ..., "arguments": {...}}]` of at most MAX_PARALLEL_CALLS for `required` — and that
JSON becomes `tool_calls`.
`none`: tools are shown to the model (as OpenAI does) and nothing is parsed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.structured import NAME_PATTERN, ResponseFormat, check_json_schema
from deployments.frontend.tools.parsers import BaseToolParser, Parsed, ParsedCall
from deployments.frontend.tools.partial import scan_forced
from shortconv.engine.outputs import FinishReason
from shortconv.sampling.grammar import GrammarSpec

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# The most calls one `required` turn may make (1 with parallel_tool_calls=false). A bound, so a
# model that never closes the list (a random one) still ends in well-formed calls.
MAX_PARALLEL_CALLS = 4


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """An assistant turn's past tool call, as clients send the history back."""

    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: `mode` is auto | none | named | required."""

    mode: str
    schemas: dict[str, dict[str, Any]]  # tool name -> parameters schema
    parser: BaseToolParser | None
    grammar: GrammarSpec | None = None
    named: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("named", "required")

    def calls(self, text: str, finish_reason: str | None) -> Parsed | None:
        """Content and tool calls of the finished output, or None when it holds no call."""
        if self.forced:
            return self._forced_calls(text) if finish_reason == FinishReason.STOP else None
        if self.mode == "auto" and self.parser is not None:
            parsed = self.parser.parse(text, self.schemas)
            known = all(c.name in self.schemas for c in parsed.calls)
            return parsed if parsed.calls and known else None
        return None

    def _forced_calls(self, text: str) -> Parsed | None:
        """The calls of a finished forced output; each call's arguments are the model's own
        text of the object (what the stream sent), checked to be JSON."""
        try:
            json.loads(text)
        except ValueError:
            return None
        raw = scan_forced(text, self.named if self.mode == "named" else None)
        if not raw or any(c.name is None or c.start is None or c.end is None for c in raw):
            return None
        return Parsed("", tuple(ParsedCall(c.name or "", c.arguments(text)) for c in raw))


def plan_tools(
    tools: list[ToolDef] | None,
    choice: ToolChoice | None,
    parallel: bool | None,
    parser: BaseToolParser | None,
) -> ToolPlan | None:
    """Check the request's tools and choice; None when it brings no tools."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in schemas:
            raise APIError(f"two tools are named {fn.name!r}", param=f"tools.{i}.function.name")
        params = fn.parameters if fn.parameters is not None else _NO_PARAMETERS
        where = f"tools.{i}.function.parameters"
        check_json_schema(params, where)
        if params.get("type") != "object":
            raise APIError(f"{where}: must be a schema of type 'object'", param=where)
        schemas[fn.name] = params
    choice = choice or "auto"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in schemas:
            raise APIError(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        grammar = GrammarSpec.json_schema(schemas[name])
        return ToolPlan("named", schemas, parser, grammar, named=name)
    if choice == "required":
        return ToolPlan("required", schemas, parser, _required_grammar(schemas, parallel))
    if choice == "auto" and parser is None:
        raise APIError(
            "this model's chat template defines no tool-call format: use tool_choice "
            "'required' or a named function",
            param="tool_choice",
        )
    return ToolPlan(choice, schemas, parser)


def chat_grammar(
    response_format: ResponseFormat | None, tools: ToolPlan | None
) -> tuple[GrammarSpec | None, str]:
    """The grammar a chat request decodes under, and the field a compile error names."""
    grammar = response_format.grammar() if response_format is not None else None
    if tools is None or not tools.forced:
        return grammar, "response_format"
    if grammar is not None:
        msg = "response_format cannot be combined with tool_choice 'required' or a named function"
        raise APIError(msg, param="response_format")
    return tools.grammar, "tools"


def _required_grammar(schemas: dict[str, dict[str, Any]], parallel: bool | None) -> GrammarSpec:
    one_of_each = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, params in schemas.items()
    ]
    most = 1 if parallel is False else MAX_PARALLEL_CALLS
    schema = {"type": "array", "items": {"anyOf": one_of_each}, "minItems": 1, "maxItems": most}
    return GrammarSpec.json_schema(schema)


def openai_tool_calls(calls: tuple[ParsedCall, ...], stream: bool) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` (a streamed delta carries each call's `index`)."""
    out = []
    for i, c in enumerate(calls):
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        out.append({"index": i, **call} if stream else call)
    return out


def history_tool_calls(calls: list[ToolCallIn], index: int) -> list[dict[str, Any]]:
    """Past calls for the chat template, arguments as objects (templates iterate them)."""
    out = []
    for j, call in enumerate(calls):
        where = f"messages.{index}.tool_calls.{j}.function.arguments"
        try:
            args = json.loads(call.function.arguments)
        except ValueError:
            raise APIError(f"{where}: not valid JSON", param=where) from None
        if not isinstance(args, dict):
            raise APIError(f"{where}: must be a JSON object", param=where)
        fn = {"name": call.function.name, "arguments": args}
        out.append({"id": call.id, "type": "function", "function": fn})
    return out
