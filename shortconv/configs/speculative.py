"""Speculative decoding's configuration: vLLM's `--speculative-config` keys, checked at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from shortconv.errors import ConfigError

METHODS = ("ngram", "draft_model")
SUPPORTED_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a request's next tokens are proposed and how many each step verifies.

    `method`: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of
    the request's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`);
    "draft_model" (a smaller checkpoint with the target's tokenizer, at `model`, proposes k
    tokens greedily: `engine.draft_proposer`).
    `num_speculative_tokens`: k, the most tokens proposed per request per step (the row then
    carries k + 1 tokens)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: the draft checkpoint's directory
    # Switch-off (engine.spec_policy): no request proposes in a step whose running batch is
    # larger than this (None: never by size); beyond it a verify row's k extra tokens make the
    # step compute-bound, so they cost about what they save.
    disable_by_batch_size: int | None = 32
    # A request whose moving average of accepted / proposed falls below this stops proposing
    # for `acceptance_backoff_steps` steps, then tries again (0.0: never). The default sits
    # near break-even for a verify step costing 1.3x a decode step at k = 4: 0.3 / 4.
    min_acceptance_rate: float = 0.1
    acceptance_backoff_steps: int = 16
    # Per request, k follows its measured acceptance (engine.spec_policy.adaptive_k): a
    # proposal position is dropped while its chance of being kept is below
    # `min_acceptance_rate`, and comes back as acceptance does.
    adaptive_k: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}"
            )
        if self.method not in SUPPORTED_METHODS:
            raise ConfigError(
                f"speculative_config.method={self.method!r} is not yet supported; "
                f"supported: {list(SUPPORTED_METHODS)}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError(
                "speculative_config.model (the draft checkpoint) is required by method "
                f"'draft_model' and taken by no other; method={self.method!r}, model={self.model!r}"
            )
        _at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        _at_least("prompt_lookup_min", self.prompt_lookup_min, 1)
        _at_least("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.disable_by_batch_size is not None:
            _at_least("disable_by_batch_size", self.disable_by_batch_size, 1)
        _fraction("min_acceptance_rate", self.min_acceptance_rate)
        _at_least("acceptance_backoff_steps", self.acceptance_backoff_steps, 1)
        if not isinstance(self.adaptive_k, bool):
            raise ConfigError(
                f"speculative_config.adaptive_k must be a bool (true or false), "
                f"got {self.adaptive_k!r}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """A config from a mapping (YAML, `LLM(speculative_config={...})`), unknown keys refused."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"speculative_config must be a mapping, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(
                f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**value)


def _at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"speculative_config.{name} must be an integer >= {low}, got {value!r}")


def _fraction(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
    if not ok:
        raise ConfigError(f"speculative_config.{name} must be a number in [0, 1], got {value!r}")
