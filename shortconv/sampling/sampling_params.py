"""User-facing sampling parameters (vLLM-shaped), validated on construction."""

from __future__ import annotations

import math
import operator
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

    MAX_STOP_STRINGS = 16
    MAX_LOGPROBS = 20

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
        self._validate()

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


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


def _is_int(x: object) -> bool:
    # bool is an int subclass; True as max_tokens/top_k/logprobs is a client bug, not 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
