"""Draft-model proposals: k tokens per speculating request, batched across requests.

Per step, for the requests about to verify (`prepare`), with `t` the request's tokens:

1. **Catch up.** The committed draft state folds in `t[:-1]` (everything but the last
   sampled token): extend rows over `t[num_committed:-1]`, packed `max_num_batched_tokens`
   to a forward. A new request's prompt is this same catch-up (lazy draft prefill, run apart
   from the target's step budget); after a verify that kept m proposals it is the m + 1
   tokens [last token, accepted proposals], so the committed state never folds in a rejected
   proposal and needs no rollback.
2. **Propose.** The committed slot is copied to the request's scratch slot, then k one-token
   forwards (one per proposal position, every request in each) feed `t[-1]`, then each
   proposal. They write KV at positions past the committed length; the next catch-up
   rewrites those positions before anything reads them.

A greedy request's draft proposes its argmax: acceptance is "the target's argmax equals the
proposal" (`engine.speculation`). A request with temperature > 0 has its draft sample each
proposal from q (`sampling.draft_sampler`), and q goes with the verify row, which then
accepts by rejection sampling (`sampling.verify_step`): its output follows the target's
distribution whatever the draft proposes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from shortconv.engine.draft_state import DraftPools, DraftSeq
from shortconv.engine.plan import SeqChunk, StepPlan, StepResult
from shortconv.engine.request import Request
from shortconv.execution.worker_spec import Capacity
from shortconv.sampling.draft_sampler import DraftSampler, draft_seed
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.sampling.sampling_row import SamplingRow, make_row


class StepRunner(Protocol):
    """What the proposer needs of the draft's `ModelRunner` (rank 0: always answers)."""

    def execute(self, plan: StepPlan) -> StepResult | None: ...


class DraftProposer:
    """The draft model's runner, pools and this step's proposals."""

    def __init__(
        self,
        runner: StepRunner,
        sampler: DraftSampler,
        capacity: Capacity,
        page_size: int,
        max_num_batched_tokens: int,
    ) -> None:
        """`sampler`: the one installed in `runner` (its q of each row drawn)."""
        self.runner = runner
        self.sampler = sampler
        self.pools = DraftPools(capacity, page_size)
        self.max_tokens = max_num_batched_tokens
        self._greedy: SamplingRow = make_row(SamplingParams(temperature=0.0), 0, (), (), ())
        self._step_ids = itertools.count(1)
        self._proposals: dict[str, tuple[int, ...]] = {}
        self._probs: dict[str, torch.Tensor] = {}

    def prepare(self, wants: Sequence[tuple[Request, int]]) -> None:
        """Propose up to k tokens for each (request, k); `propose` hands them out."""
        self._proposals, self._probs = {}, {}
        seqs: list[tuple[Request, int, DraftSeq]] = []
        for req, k in wants:
            seq = self.pools.reserve(req.request_id, req.num_tokens - 1 + k)
            if seq is not None:
                seqs.append((req, k, seq))
        self._catch_up([(req, seq) for req, _, seq in seqs])
        if seqs:
            self._draft(seqs)

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        """req's first k proposals of this step (none when it was not prepared)."""
        return self._proposals.pop(req.request_id, ())[:k]

    def probs(self, req: Request, k: int) -> torch.Tensor | None:
        """q [k, V] of req's first k proposals this step; None where they are its draft's
        argmax (a greedy request)."""
        q = self._probs.pop(req.request_id, None)
        return None if q is None else q[:k]

    def release(self, req: Request) -> None:
        """req left (finished, aborted) or was preempted: its draft slots and pages go back."""
        self._proposals.pop(req.request_id, None)
        self._probs.pop(req.request_id, None)
        self.pools.release(req.request_id)

    def num_held(self) -> tuple[int, int]:
        return self.pools.num_held()

    def _catch_up(self, seqs: list[tuple[Request, DraftSeq]]) -> None:
        pending = [(req, seq.num_committed) for req, seq in seqs]
        while pending := [(r, c) for r, c in pending if c < r.num_tokens - 1]:
            budget, chunks = self.max_tokens, []
            for i, (req, done) in enumerate(pending):
                n = min(req.num_tokens - 1 - done, budget)
                if n < 1:
                    break
                chunks.append(self._chunk(req, req.all_token_ids[done : done + n], done))
                pending[i] = (req, done + n)
                self.pools.commit(req.request_id, done + n)
                budget -= n
            self._run(StepPlan(next(self._step_ids), tuple(chunks)))

    def _draft(self, seqs: list[tuple[Request, int, DraftSeq]]) -> None:
        out: dict[str, list[int]] = {req.request_id: [] for req, _, _ in seqs}
        qs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _, _ in seqs}
        copies = tuple((seq.slot, seq.scratch) for _, _, seq in seqs)
        for i in range(max(k for _, k, _ in seqs)):
            chunks = tuple(
                self._chunk(
                    req,
                    [out[req.request_id][-1] if i else req.all_token_ids[-1]],
                    req.num_tokens - 1 + i,
                    row=self._row(req, i),
                )
                for req, k, _ in seqs
                if k > i
            )
            plan = StepPlan(next(self._step_ids), chunks, copies_before=copies if not i else ())
            for (rid, tok), q in zip(self._tokens(plan), self.sampler.last_probs, strict=True):
                out[rid].append(tok)
                if q is not None:
                    qs[rid].append(q)
        self._proposals = {rid: tuple(toks) for rid, toks in out.items()}
        self._probs = {rid: torch.stack(q) for rid, q in qs.items() if q}

    def _row(self, req: Request, i: int) -> SamplingRow:
        """Proposal i's row: the argmax for a greedy request; else a draw from the request's
        temperature / top-k / top-p on the draft's logits, seeded by (request seed, the
        verify's step, i) apart from the target's draws."""
        if req.params.greedy:
            return self._greedy
        return SamplingRow(req.params, draft_seed(req.seed, len(req.output_token_ids)), i)

    def _chunk(
        self, req: Request, tokens: Sequence[int], start: int, row: SamplingRow | None = None
    ) -> SeqChunk:
        """A catch-up chunk on the committed slot; with `row`, a proposal on the scratch."""
        seq = self.pools.seqs[req.request_id]
        return SeqChunk(
            request_id=req.request_id,
            token_ids=tuple(tokens),
            start_pos=start,
            slot=seq.scratch if row is not None else seq.slot,
            block_table=seq.pages[0],
            sampling=row,
            window_tables=seq.pages[1:],
        )

    def _tokens(self, plan: StepPlan) -> Iterator[tuple[str, int]]:
        result = self._run(plan)
        return zip(result.request_ids, result.token_ids, strict=True)

    def _run(self, plan: StepPlan) -> StepResult:
        result = self.runner.execute(plan)
        assert result is not None  # the draft runs unsharded: its runner is rank 0
        return result
