"""OpenAI request schemas (pydantic, validated at the HTTP edge) and their engine translation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.frontend.openai.content import ContentPart, ImageRef, content_part
from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.fields import ChatIgnoredFields, IgnoredFields
from deployments.frontend.openai.structured import ResponseFormat
from deployments.frontend.openai.tools import ToolCallIn, ToolChoice, ToolDef, history_tool_calls
from shortconv.sampling.grammar import GrammarSpec
from shortconv.sampling.sampling_params import InvalidRequest, SamplingParams

MAX_TOP_LOGPROBS = SamplingParams.MAX_LOGPROBS
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPTS = 64  # prompts in one completions request


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
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (with include_usage)


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class _SamplingFields(IgnoredFields):
    # NOTE: unknown fields are refused (like OpenAI's "Unrecognized request argument"), so a
    # misspelt knob is a 400 instead of being silently ignored. Strict types: "16" is not an
    # int and "yes" is not a bool (OpenAI refuses both), and NaN/Infinity are no numbers.
    model_config = _STRICT

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # extension (vLLM): <= 0 disables
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension (vLLM)
    n: int = Field(1, ge=1, le=INT32_MAX)  # above the engine's max_n: its 400 names `n`
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False  # extension (vLLM)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)  # extension (vLLM)
    logit_bias: dict[str, Bias] | None = Field(None, max_length=SamplingParams.MAX_LOGIT_BIAS)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)  # extension (vLLM)
    skip_special_tokens: bool = True  # extension (vLLM)
    speculative: bool = True  # extension: false keeps this request off speculative decoding

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
                raise ValueError(f"keys must be integer token ids, got {key!r}")
        return v

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            msg = "stream_options is only allowed with stream=true"
            raise APIError(msg, param="stream_options")

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
            skip_special_tokens=skip_special_tokens and self.skip_special_tokens,
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
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            n=self.n,
            speculative=self.speculative,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM's `continuous_usage_stats`, as vLLM: only
        together with `include_usage`)."""
        opts = self.stream_options
        return bool(opts and opts.include_usage and opts.continuous_usage_stats)


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

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or token-id list, or a list of them (vLLM serves a list as
        one request with one choice per prompt)."""
        p = self.prompt
        many = isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))
        prompts: list[str | list[int]] = list(p) if many else [p]  # type: ignore[list-item, arg-type]
        if len(prompts) > MAX_PROMPTS:
            msg = f"{len(prompts)} prompts in one request; at most {MAX_PROMPTS}"
            raise APIError(msg, param="prompt")
        for i, one in enumerate(prompts):
            if not one:
                raise APIError("prompt is empty", param=f"prompt.{i}" if many else "prompt")
        return prompts

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo and self.logprobs is not None:
            raise APIError(
                "echo with logprobs needs the prompt's logprobs, which this server does not "
                "compute (the model's head runs on the last prompt position only)",
                param="echo",
            )
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError("best_of must be 1", param="best_of")


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns

    def template_dict(self, index: int, text: bool = True) -> dict[str, Any]:
        """The message as the chat template sees it (text content, call arguments parsed)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text(index) if text else None}
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
        texts = []
        for j, part in enumerate(self.content):
            one = content_part(index, j, part)
            if "url" in one:  # NOTE: chat requests with images take the multimodal path
                where = f"messages.{index}.content.{j}"
                raise APIError(f"{where}: images are not accepted here", param=where)
            texts.append(one["text"])
        return "".join(texts)

    def images(self, index: int) -> list[ImageRef]:
        """The message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        parts = [(j, content_part(index, j, p)) for j, p in enumerate(self.content)]
        where = f"messages.{index}.content"
        return [ImageRef(p["url"], f"{where}.{j}.image_url") for j, p in parts if "url" in p]

    def multimodal_dict(self, index: int) -> dict[str, Any]:
        """The message for a processor's chat template: content as text and image parts (an
        image part as `{"type": "image"}`: the processor is handed the images themselves)."""
        content = self.content
        msg = self.template_dict(index, text=not isinstance(content, list))
        if isinstance(content, list):
            parts = [content_part(index, j, p) for j, p in enumerate(content)]
            msg["content"] = [{"type": "image"} if "url" in p else p for p in parts]
        return msg


class ChatCompletionRequest(_SamplingFields, ChatIgnoredFields):
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

    def image_refs(self) -> list[ImageRef]:
        """Every image of the conversation, in order (none: the text-only path)."""
        return [ref for i, m in enumerate(self.messages) for ref in m.images(i)]

    def multimodal_messages(self) -> list[dict[str, Any]]:
        return [m.multimodal_dict(i) for i, m in enumerate(self.messages)]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's shape, as vLLM passes them)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]
