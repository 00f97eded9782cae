"""One grammar matcher per constrained request, on the engine's (host) side of the plan.

The scheduler asks `row_masks` for the next allowed-token bitmasks of each constrained request
while it plans that request's rows, so the plan is built once with its masks (the plan crosses
to TP rank 0, so each row carries its own bytes); after sampling, `accept` advances that
request's matcher by the token it got. A matcher follows the request's output tokens only, so
preemption and recompute need nothing.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

from shortconv.sampling.grammar.compiler import GrammarCache
from shortconv.sampling.grammar.spec import GrammarError, GrammarSpec
from shortconv.sampling.grammar.spec_verify import allowed_prefix, fill_verify_masks


class GrammarRuntime:
    """Matchers by request id; xgrammar is touched only once a request brings a grammar."""

    def __init__(self, hf_tokenizer: Any | None, vocab_size: int, stop_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        # NOTE: built now (it imports nothing): validation reaches it from another thread.
        self._cache = GrammarCache(hf_tokenizer, vocab_size, stop_ids) if hf_tokenizer else None
        self._matchers: dict[str, Any] = {}
        # xgrammar's int32 bitmask (torch) and its numpy view: rows reused by every request.
        self._scratch: Any = None
        self._words: Any = None

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            raise GrammarError("structured output needs a tokenizer; this checkpoint has none")
        return self._cache

    @property
    def num_active(self) -> int:
        return len(self._matchers)

    def check(self, spec: GrammarSpec) -> None:
        """Compile now (cached), so a bad grammar is refused before the request is queued."""
        self.cache.get(spec)

    def row_masks(
        self, request_id: str, spec: GrammarSpec, draft: Sequence[int] = ()
    ) -> tuple[bytes, ...]:
        """The allowed-token masks of a constrained request's next rows, asked by the scheduler
        as it plans them: one, or a verify row's len(draft) + 1 (position i's after proposals
        0..i-1, `spec_verify`). Raises GrammarError when its grammar cannot go on (a row allows
        no token, or a proposal it refuses: the scheduler checked them, so that is a defect)."""
        n = len(draft) + 1
        if self._scratch is None or self._scratch.shape[0] < n:
            import xgrammar as xgr

            self._scratch = xgr.allocate_token_bitmask(n, self.vocab_size)
            self._words = self._scratch.numpy()
        words = self._words[:n]
        # NOTE: all-allowed first, as a fresh bitmask: xgrammar may leave an all-true row as is.
        words.fill(-1)
        fill_verify_masks(self._matcher(request_id, spec), draft, self._scratch, 0)
        if not words.any(axis=1).all():
            raise GrammarError("the output grammar allows no next token")
        return tuple(w.tobytes() for w in words)  # NOTE: copies: each row crosses on its own

    def allowed_draft(self, request_id: str, spec: GrammarSpec, draft: Sequence[int]) -> int:
        """How many leading proposals of a speculating request its grammar allows (the
        scheduler cuts the rest before the verify row is planned)."""
        return allowed_prefix(self._matcher(request_id, spec), draft)

    def accept(self, request_id: str, token: int, done: bool) -> bool:
        """Advance by the sampled token; True when the grammar is complete (the request should
        stop). Raises GrammarError for a token the grammar refuses. `done`: the request has
        finished anyway, so its matcher goes."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token):
            del self._matchers[request_id]
            raise GrammarError(f"token {token} does not fit the output grammar")
        finished = bool(matcher.is_terminated())
        if finished or done:
            del self._matchers[request_id]
        return finished

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def _matcher(self, request_id: str, spec: GrammarSpec) -> Any:
        m = self._matchers.get(request_id)
        if m is None:
            import xgrammar as xgr

            m = xgr.GrammarMatcher(self.cache.get(spec))
            self._matchers[request_id] = m
        return m

    def prune(self, live: Container[str]) -> None:
        """Drop the matchers of requests that ended without a last `accept` (aborted, failed,
        cut by a stop string); the scheduler calls it once per step."""
        for rid in [r for r in self._matchers if r not in live]:
            del self._matchers[rid]
