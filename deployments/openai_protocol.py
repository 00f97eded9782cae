"""OpenAI request schemas (pydantic, validated at the HTTP edge) and their engine translation."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from deployments.openai_errors import APIError
from deployments.openai_structured import ResponseFormat
from deployments.openai_tools import ToolCallIn, ToolChoice, ToolDef, history_tool_calls
from shortconv.sampling.grammar import GrammarSpec
from shortconv.sampling.sampling_params import InvalidRequest, SamplingParams

MAX_TOP_LOGPROBS = SamplingParams.MAX_LOGPROBS
MAX_STOP_TOKEN_IDS = 64


# Pydantic names the union member that failed in `loc` ("str", "list[int]", ...); a client
# wants the field path only.
_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)(\[.*\])?$|.*[\[(]")


def from_validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    parts = []
    for p in err.get("loc", ()):
        if isinstance(p, str) and (p == "body" or _UNION_TAG.match(p)):
            continue
        parts.append(str(p))
    param = ".".join(parts) or None
    return APIError(f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param=param)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or APIError (400): not UTF-8, not JSON, NaN/Infinity (not
    JSON, though Python accepts them), ints past Python's digit limit, nesting past the
    recursion limit, or a lone surrogate escape ("\\ud800", which no tokenizer can encode)."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError too
        raise APIError(f"request body is not valid JSON: {exc}"[:500]) from None
    if not isinstance(data, dict):
        raise APIError("request body must be a JSON object")
    bad = _lone_surrogate_at(data)
    if bad is not None:
        raise APIError(f"{bad}: not valid Unicode (lone surrogate escape)", param=bad)
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _lone_surrogate_at(data: Any) -> str | None:
    """Path of the first string (value or key) that cannot be encoded as UTF-8, else None."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # NOTE: iterative: the depth is already bounded by json's recursion limit
        path, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                sub = f"{path}.{k}" if path else str(k)
                stack += [(path or "body", k), (sub, x)]
        elif isinstance(v, list):
            stack += [(f"{path}.{i}", x) for i, x in enumerate(v)]
    return None


def check_context(num_prompt: int, max_tokens: int, max_model_len: int) -> None:
    """Prompt + max_tokens must fit the context (OpenAI and vLLM refuse rather than truncate);
    a prompt that alone is too long is refused by the engine's own check, naming the prompt."""
    if num_prompt < max_model_len < num_prompt + max_tokens:
        raise APIError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt} and max_tokens asks for {max_tokens} more",
            param="max_tokens",
            code="context_length_exceeded",
        )


def make_sampling_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams from request fields; its refusal becomes a 400 naming the field."""
    try:
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except InvalidRequest as exc:
        raise APIError(str(exc), param=exc.param) from None


# OpenAI's seed is an int64; ids and top_k fit an int32. Bounds keep huge JSON ints from
# reaching torch (overflow) and document the limits in the OpenAPI schema.
INT64 = (-(1 << 63), (1 << 63) - 1)
INT32_MAX = (1 << 31) - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # NOTE: unknown fields are refused (like OpenAI's "Unrecognized request argument"), so a
    # misspelt knob is a 400 instead of being silently ignored. Strict types: "16" is not an
    # int and "yes" is not a bool (OpenAI refuses both), and NaN/Infinity are no numbers.
    model_config = _STRICT

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # extension (vLLM): <= 0 disables
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension (vLLM)
    n: int = Field(1, json_schema_extra={"minimum": 1, "maximum": 1})  # see below
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False  # extension (vLLM)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            msg = "stream_options is only allowed with stream=true"
            raise APIError(msg, param="stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported (must be 0)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")

    def sampling(
        self,
        max_tokens: int,
        logprobs: int | None,
        grammar: GrammarSpec | None = None,
        skip_special_tokens: bool = True,
    ) -> SamplingParams:
        self.check_unsupported()
        return make_sampling_params(
            grammar=grammar,
            skip_special_tokens=skip_special_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # The OpenAPI document's example (schema fuzzers send it first, so it must be answerable).
    model_config = ConfigDict(**_STRICT, json_schema_extra={"examples": [{"prompt": "Hello"}]})
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None  # an extension here (vLLM has it too)

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError("only one prompt per request is supported", param="prompt")
            p = p[0]  # type: ignore[assignment]
        if not p:
            raise APIError("prompt is empty", param="prompt")
        return p  # type: ignore[return-value]

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError("best_of must be 1", param="best_of")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it (text content, call arguments parsed)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        if self.tool_calls:
            if self.role != "assistant":
                where = f"messages.{index}.tool_calls"
                raise APIError(f"{where}: only assistant messages carry tool calls", param=where)
            msg["tool_calls"] = history_tool_calls(self.tool_calls, index)
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(
                    f"content part of type {part.type!r} is not supported (text only)",
                    param=f"messages.{index}.content",
                )
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(
        **_STRICT,
        json_schema_extra={"examples": [{"messages": [{"role": "user", "content": "Hello"}]}]},
    )
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # extension (vLLM)
    response_format: ResponseFormat | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict(i) for i, m in enumerate(self.messages)]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's shape, as vLLM passes them)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]
