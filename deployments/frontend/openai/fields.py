"""Request fields we accept without acting on them, accept at their default only, or refuse.

OpenAI's SDKs and the tools built on them (benchmark tools, agent frameworks) send fields that
change nothing here; refusing them would turn those clients away, so they are declared (typed,
so a wrong type is still a 400) and ignored. vLLM's extensions that we do not implement are
accepted at their default value only, and fields whose meaning we cannot honour (audio output,
non-text modalities) are refused naming themselves. Anything not declared anywhere is still
refused (a misspelt field is a 400). docs/openai_api.md lists all three groups.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

# vLLM extensions accepted at these values only (what vLLM does by default).
_DEFAULT_ONLY = (
    "use_beam_search",
    "include_stop_str_in_output",
    "spaces_between_special_tokens",
    "priority",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "length_penalty",
)


class IgnoredFields(BaseModel):
    """Both routes: accepted, typed, ignored; and vLLM's extensions at their default."""

    model_config = _STRICT

    # OpenAI: end-user ids, tags, billing tier, stored completions, cache and abuse hints.
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM: accepted at the default only (see _DEFAULT_ONLY).
    use_beam_search: bool = False
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    length_penalty: float = 1.0

    @field_validator(*_DEFAULT_ONLY)
    @classmethod
    def _at_default_only(cls, v: Any, info: ValidationInfo) -> Any:
        default = cls.model_fields[info.field_name].default  # type: ignore[index]
        if v != default:
            raise ValueError(f"only {default!r} is supported")
        return v


class ChatIgnoredFields(IgnoredFields):
    """Chat only: OpenAI's reasoning and latency hints (the models here do not reason), and
    what we refuse: audio output, non-text modalities, the deprecated `functions`."""

    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    echo: bool = False  # vLLM's chat extension (the last message repeated)
    continue_final_message: bool = False  # vLLM
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    web_search_options: dict[str, Any] | None = None

    @field_validator("echo", "continue_final_message")
    @classmethod
    def _false_only(cls, v: bool, info: ValidationInfo) -> bool:
        if v:
            raise ValueError(f"{info.field_name} is not supported on chat")
        return v

    @field_validator("audio", "functions", "function_call", "web_search_options")
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            why = {"functions": "use tools", "function_call": "use tool_choice"}
            hint = why.get(info.field_name or "", "only text output is served")
            raise ValueError(f"{info.field_name} is not supported ({hint})")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and set(v) != {"text"}:
            raise ValueError(f"only ['text'] is supported, got {v!r}")
        return v
