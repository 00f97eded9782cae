"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a request ended; the values are the wire format (OpenAI's `finish_reason`, where it
    has a word for it) and the metrics' `reason` label."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TIMEOUT = "timeout"  # the Serve layer's deadline (deployments/frontend/openai/format.py)


@dataclass
class RequestOutput:
    """Cumulative result of one request; `finished` once finish_reason is set.

    token_ids are the generated ids only. A request with `SamplingParams.n` > 1 has one output
    per fork, each with the request's id and its own `index` (0..n-1, the choice index).
    `num_cached_tokens` counts prompt tokens resumed from kept session state (not recomputed).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    new_text: str = ""  # text added by the latest step (for streaming)
    new_token_ids: list[int] = field(default_factory=list)
    index: int = 0  # the fork (choice) this output is of; 0 without forks

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
