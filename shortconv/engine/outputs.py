"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """Cumulative result of one request; `finished` once finish_reason is set.

    token_ids are the generated ids only. finish_reason: stop | length | abort | error.
    `num_cached_tokens` counts prompt tokens resumed from kept session state (not recomputed).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    new_text: str = ""  # text added by the latest step (for streaming)
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
