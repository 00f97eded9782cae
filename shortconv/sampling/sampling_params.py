"""User-facing sampling parameters (vLLM-shaped), validated on construction."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

from shortconv.sampling.grammar.spec import GrammarSpec


class InvalidRequest(ValueError):
    """Bad input for one request; `param` names the request field at fault, set where it is
    raised, so the HTTP layer's 400 names it without reading the message."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature == 0 means greedy. top_k <= 0 disables top-k. logprobs=None returns no
    logprobs; logprobs=0 returns the chosen token's logprob; logprobs=k also returns the k
    most likely tokens. Logprobs are of the model's raw distribution (before temperature and
    truncation), like vLLM's default. `grammar` restricts every sampled token to those the
    grammar allows (the request stops once the grammar is complete).

    Logit controls, applied in this order before temperature and truncation: `logit_bias`
    (token id -> bias in [-100, 100], added to the logit; a mapping is frozen into sorted
    pairs), `min_tokens` (EOS and `stop_token_ids` refused until that many tokens have been
    generated; vLLM's extension), `repetition_penalty` (vLLM's: a logit of a token seen in the
    prompt or the output is divided by it when positive, multiplied when negative), then
    OpenAI's `frequency_penalty` (times the token's count in the output) and `presence_penalty`
    (once if it occurs in the output), both subtracted.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: GrammarSpec | None = None  # constrain the output (JSON schema / JSON object)
    skip_special_tokens: bool = True  # False keeps e.g. tool-call markers in the text
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    n: int = 1  # forks from one prefill, each sampled with its own generator (`fork_seed`)
    # False: this request never speculates, even on an engine with a `speculative_config`.
    speculative: bool = True

    MAX_STOP_STRINGS = 16
    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 1024  # entries; OpenAI documents 300
    MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)

    def __post_init__(self) -> None:
        # NOTE: lists are accepted for convenience and frozen into tuples so the object is hashable.
        # None is what JSON clients send for "no stop"; a bare string is one stop string.
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        try:
            object.__setattr__(self, "stop", tuple(stop))
        except TypeError:
            msg = f"SamplingParams.stop must be a sequence, got {stop!r}"
            raise InvalidRequest(msg, "stop") from None
        object.__setattr__(self, "stop_token_ids", _token_ids(ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        self._validate()
        self._validate_controls()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"SamplingParams.{name} {why}", name)

        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k):
            raise bad("top_k", f"must be an int, got {self.top_k!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an int or None, got {self.seed!r}")
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", f"must be an int >= 1, got {self.n!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an int >= 1, got {self.max_tokens!r}")
        if len(self.stop) > self.MAX_STOP_STRINGS:
            raise bad("stop", f"has {len(self.stop)} strings; at most {self.MAX_STOP_STRINGS}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must contain non-empty strings only")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be non-negative, got {self.stop_token_ids!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise bad("grammar", f"must be a GrammarSpec or None, got {self.grammar!r}")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= self.MAX_LOGPROBS):
            raise bad("logprobs", f"must be None or an int in [0, {self.MAX_LOGPROBS}], got {lp!r}")

    def _validate_controls(self) -> None:
        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"SamplingParams.{name} {why}", name)

        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or abs(v) > self.MAX_PENALTY:
                raise bad(
                    name, f"must be in [-{self.MAX_PENALTY:g}, {self.MAX_PENALTY:g}], got {v!r}"
                )
        rp = self.repetition_penalty
        if not _finite(rp) or rp <= 0:
            raise bad("repetition_penalty", f"must be a finite number > 0, got {rp!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an int in [0, max_tokens], got {self.min_tokens!r}")
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            raise bad(
                "logit_bias", f"has {len(self.logit_bias)} entries; at most {self.MAX_LOGIT_BIAS}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_output_counts(self) -> bool:
        """The sampler needs the generated tokens (presence, frequency, repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.needs_prompt_tokens

    @property
    def needs_prompt_tokens(self) -> bool:
        """The sampler needs the prompt's tokens too (repetition penalty only)."""
        return self.repetition_penalty != 1.0


def _token_ids(ids: object) -> tuple[int, ...]:
    # operator.index admits numpy ints but rejects floats and strings, so 1.5 is an error rather
    # than silently becoming token 1 (which int() would do).
    try:
        items = list(ids)  # type: ignore[call-overload]
        if any(isinstance(t, bool) for t in items):
            raise TypeError("bool is not a token id")
        return tuple(operator.index(t) for t in items)
    except TypeError:
        msg = f"SamplingParams.stop_token_ids must be int token ids, got {ids!r}"
        raise InvalidRequest(msg, "stop_token_ids") from None


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """Sorted (token id, bias) pairs from a mapping (JSON's keys are strings: "50256") or
    pairs; every id a non-negative int, every bias a number in [-100, 100]."""
    if bias is None:
        return ()
    try:
        source = bias.items() if isinstance(bias, Mapping) else bias
        pairs = [(key, value) for key, value in source]  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        msg = f"SamplingParams.logit_bias must map token ids to biases, got {bias!r}"
        raise InvalidRequest(msg[:300], "logit_bias") from None
    out: dict[int, float] = {}
    for key, value in pairs:
        if not _finite(value) or not -100.0 <= value <= 100.0:
            why = f"must be a number in [-100, 100], got {value!r}"
            raise InvalidRequest(f"SamplingParams.logit_bias[{key!r}] {why}", "logit_bias")
        out[_bias_token_id(key)] = float(value)
    return tuple(sorted(out.items()))


def _bias_token_id(key: object) -> int:
    """A token id key: an int, or a string of decimal digits (how JSON carries int keys)."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if _is_int(key) and key >= 0:  # type: ignore[operator]
        return key  # type: ignore[return-value]
    msg = f"SamplingParams.logit_bias keys must be non-negative integer token ids, got {key!r}"
    raise InvalidRequest(msg, "logit_bias")


def _is_int(x: object) -> bool:
    # bool is an int subclass; True as max_tokens/top_k/logprobs is a client bug, not 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
