"""One grammar matcher per constrained request, on the engine's (host) side of the plan.

Each step the engine asks `attach` to put the next allowed-token bitmask on every sampling row
of a constrained request (the plan crosses to TP rank 0, so each row carries its own bytes);
after sampling, `accept` advances that request's matcher by the token it got. A matcher follows
the request's output tokens only, so preemption and recompute need nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterator, Sequence
from typing import Any, TypeVar

from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.sampling.grammar.compiler import GrammarCache
from shortconv.sampling.grammar.spec import GrammarError, GrammarSpec
from shortconv.sampling.grammar.spec_verify import allowed_prefix, fill_verify_masks
from shortconv.sampling.sampling_row import SamplingRow

_T = TypeVar("_T")
# (request id, its sampling rows in order, the proposals before its last row)
_Wanted = tuple[str, tuple[SamplingRow, ...], tuple[int, ...]]


class GrammarRuntime:
    """Matchers by request id; xgrammar is touched only once a request brings a grammar."""

    def __init__(self, hf_tokenizer: Any | None, vocab_size: int, stop_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        # NOTE: built now (it imports nothing): validation reaches it from another thread.
        self._cache = GrammarCache(hf_tokenizer, vocab_size, stop_ids) if hf_tokenizer else None
        self._matchers: dict[str, Any] = {}

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

    def attach(self, plan: StepPlan, live: Container[str]) -> tuple[StepPlan, dict[str, str]]:
        """The plan with a token mask on each constrained sampling row (a forking parent's
        chunk has one per fork, each with its fork's own matcher; a verify row one per
        position, `spec_verify`), and the requests to fail instead ({request id: why}), their
        rows dropped: a grammar that allows no token."""
        self._prune(live)
        wanted = [w for c in plan.seqs for w in _constrained(c)]
        if not wanted:
            return plan, {}
        import xgrammar as xgr

        masks = xgr.allocate_token_bitmask(sum(len(rows) for _, rows, _ in wanted), self.vocab_size)
        dead = self._fill(wanted, masks)
        alive = masks.any(dim=1).tolist()
        words = masks.numpy()
        rows: dict[str, tuple[SamplingRow, ...]] = {}
        first = 0
        for rid, reqrows, _ in wanted:
            span = range(first, first + len(reqrows))
            first += len(reqrows)
            if rid in dead:
                continue
            if not all(alive[i] for i in span):
                dead[rid] = "the output grammar allows no next token"
                continue
            # NOTE: bytes, not a view of `masks`: a pickled view would carry the whole batch's
            # storage in every row when the plan crosses to a TP rank.
            rows[rid] = tuple(
                _with(r, token_mask=words[i].tobytes()) for r, i in zip(reqrows, span, strict=True)
            )
        gone = {c.request_id for c in plan.seqs if _all_dead(c, dead)}
        seqs = tuple(_masked(c, rows, dead) for c in plan.seqs if c.request_id not in gone)
        slots = {c.slot for c in plan.seqs if c.request_id in gone}
        copies = tuple(p for p in plan.copies_after if p[0] not in slots)
        return dataclasses.replace(plan, seqs=seqs, copies_after=copies), dead

    def _fill(self, wanted: list[_Wanted], masks: Any) -> dict[str, str]:
        """Fill each request's mask rows in order; the requests whose proposals the grammar
        refuses ({request id: why}; the scheduler checked them, so this is a defect)."""
        dead: dict[str, str] = {}
        first = 0
        for rid, rows, draft in wanted:
            grammar = rows[0].params.grammar
            assert grammar is not None  # NOTE: `wanted` holds constrained rows only
            try:
                fill_verify_masks(self._matcher(rid, grammar), draft, masks, first)
            except GrammarError as exc:
                dead[rid] = str(exc)
            first += len(rows)
        return dead

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

    def _prune(self, live: Container[str]) -> None:
        """Matchers of requests that ended without a last `accept` (aborted, failed, length)."""
        for rid in [r for r in self._matchers if r not in live]:
            del self._matchers[rid]


def _all_dead(chunk: SeqChunk, dead: Container[str]) -> bool:
    """Every request that samples from `chunk` is to fail (a forking parent's chunk runs while
    any of its forks lives)."""
    if chunk.fork_rows:
        return all(rid in dead for rid, _ in chunk.fork_rows)
    return chunk.request_id in dead


def _masked(
    chunk: SeqChunk, rows: dict[str, tuple[SamplingRow, ...]], dead: Container[str]
) -> SeqChunk:
    """`chunk` with its masked rows (a verify row's, one per position), a forking parent's
    without its dead forks' rows."""
    if chunk.sampling is not None:
        got = rows.get(chunk.request_id)
        return chunk if got is None else _with(chunk, sampling=got[-1], draft_rows=got[:-1])
    if not chunk.fork_rows:
        return chunk
    forks = tuple(
        (rid, rows[rid][0] if rid in rows else row)
        for rid, row in chunk.fork_rows
        if rid not in dead
    )
    return _with(chunk, fork_rows=forks)


def _constrained(chunk: SeqChunk) -> Iterator[_Wanted]:
    """(request id, its rows, the proposals before its last row) of each constrained request
    that samples from `chunk`: a verify row's k + 1 rows with its k proposals, else one row."""
    if chunk.sampling is not None:
        if chunk.sampling.params.grammar is not None:
            draft = chunk.token_ids[chunk.num_tokens - chunk.num_draft :]
            yield chunk.request_id, (*chunk.draft_rows, chunk.sampling), draft
        return
    for rid, row in chunk.fork_rows:
        if row.params.grammar is not None:
            yield rid, (row,), ()


def _with(obj: _T, **changes: Any) -> _T:
    """`dataclasses.replace` for the plan's frozen dataclasses (no slots, no __post_init__) at a
    fraction of its cost: replace re-inspects the fields on every call, and this runs twice per
    constrained row per step, a measurable share of the grammar's step cost."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__, **changes)
    return new
