"""`POST /v1/responses` request schema (pydantic, validated at the HTTP edge).

Only what docs/openai_api.md lists for the Responses API: `input` (a string or items),
`instructions`, `max_output_tokens`, the sampling fields, `text.format`, function `tools` and
`tool_choice`, `stream`, `store` and `previous_response_id`. Fields that change nothing here
are typed and ignored; anything else is refused naming itself (`extra="forbid"`), as on chat.
Input items stay plain dicts here: deployments/frontend/responses/convert.py reads them one by one,
so an item of an unknown type is a 400 naming `input.<i>.type`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.frontend.openai.protocol import INT32_MAX, INT64, Penalty
from deployments.frontend.openai.structured import NAME_PATTERN
from deployments.frontend.openai.tools import FunctionDef

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
MAX_INPUT_ITEMS = 1024
ResponseId = Field(None, min_length=1, max_length=256)


class TextFormat(BaseModel):
    """`text.format`: Responses' flat form of chat's `response_format`."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: str | None = None  # a reasoning models' hint: ignored


class FunctionTool(FunctionDef):
    """A function tool in Responses' flat shape (chat's function, no `function` wrapper)."""

    type: Literal["function"]


class NamedFunction(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(**_STRICT, json_schema_extra={"examples": [{"input": "Hello"}]})

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(max_length=MAX_INPUT_ITEMS)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # extension (vLLM)
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension (vLLM)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])  # extension (vLLM)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stop: str | list[str] | None = None  # extension (vLLM; guidellm sends `stop: null`)
    ignore_eos: bool = False  # extension (vLLM; guidellm sends it for fixed output lengths)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = ResponseId
    # Accepted and ignored: tags, end-user ids, billing tier, cache hints, and what the SDKs
    # send at its default (no reasoning here; nothing extra to include; no truncation).
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = Field(None, max_length=0)
    truncation: Literal["disabled"] | None = None
    stream_options: dict[str, bool] | None = None  # only `include_obfuscation` exists

    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text else None
