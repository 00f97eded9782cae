"""Continuous batching: admit, chunk, preempt and release, one StepPlan per step (pure Python)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.manager import CacheManager, StepCopies
from shortconv.cache.window_pages import WindowGroup
from shortconv.configs.speculative import SpeculativeConfig
from shortconv.engine.encoder_planner import EncoderPlanner
from shortconv.engine.forks import copied_by_all, make_forks, ready_to_fork
from shortconv.engine.outputs import FinishReason
from shortconv.engine.plan import SeqChunk, StepPlan, StepResult
from shortconv.engine.request import Request, Status
from shortconv.engine.speculation import Speculator
from shortconv.engine.step_rows import StepGrammar, StepRows
from shortconv.sampling.sampling_row import SamplingRow

if TYPE_CHECKING:
    from shortconv.engine.draft_proposer import DraftProposer


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    eos_token_ids: tuple[int, ...] = ()
    session_ttl_s: float = 600.0
    enable_prefix_caching: bool = False
    checkpoint_interval: int = 64  # prompt tokens between checkpoints (whole pages)
    # Prompt tokens a step may carry while any request decodes (0: the whole budget).
    max_prefill_tokens_while_decoding: int = 0
    speculative: SpeculativeConfig | None = None  # None: no request speculates


class Scheduler:
    """Admits, chunks, preempts and finishes requests; their slots, pages, checkpoints and
    session pins are the cache manager's, asked on every path (finish, abort, preempt free)."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        slots: SlotAllocator,
        pages: PageAllocator,
        windows: Sequence[WindowGroup] = (),
        draft: DraftProposer | None = None,
        grammar: StepGrammar | None = None,
    ):
        """`grammar`: the engine's grammar runtime. It cuts a constrained request's proposals
        where its grammar forbids one, before its verify row is planned (so its pages are grown
        for what it verifies), and gives each constrained row its mask as the row is planned."""
        self.cfg = cfg
        self.rows = StepRows(cfg.eos_token_ids, grammar)
        self.cache_manager = CacheManager(
            slots,
            pages,
            cfg.page_size,
            prefix_caching=cfg.enable_prefix_caching,
            checkpoint_interval=cfg.checkpoint_interval,
            session_ttl_s=cfg.session_ttl_s,
            windows=windows,
        )
        self.encoder = EncoderPlanner()
        self.speculator = Speculator(cfg.speculative, draft)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._step_id = 0
        self._released: list[str] = []  # left the running batch since the last plan

    # ---- queue management -------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request; one with `n` > 1 is queued as the parent that computes its prompt
        and samples its forks' first tokens, its forks waiting for that (`engine/forks.py`)."""
        if req.params.n > 1:
            make_forks(req)
        for r in (req, *req.forks):
            if r.request_id in self.requests:
                raise ValueError(f"duplicate request id {r.request_id!r}")
        for r in (req, *req.forks):
            self.requests[r.request_id] = r
        self.waiting.append(req)

    def _fork(self, parent: Request) -> None:
        """The parent's prompt is computed: its forks queue first in line (their prompt has been
        admitted already) and it holds its state until they have copied it."""
        self.running.remove(parent)
        self._released.append(parent.request_id)
        parent.status = Status.FORKING
        for fork in parent.forks:
            fork.num_cached_tokens = parent.num_cached_tokens
        self.waiting.extendleft(reversed([f for f in parent.forks if not f.finished]))

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.finish(req, FinishReason.ABORT)
        return req

    def finish(self, req: Request, reason: FinishReason, keep_state: bool = True) -> None:
        """A request leaves; a parent takes its unfinished forks with it, and the last fork of
        a parent to leave takes the parent. `keep_state` False: its state is not kept as an
        end-of-generation checkpoint (its output was cut behind what its state folded in)."""
        self._leave(req, reason, keep_state)
        for fork in req.forks:
            if not fork.finished:
                self._leave(fork, reason)
        parent = req.parent
        if parent is not None and not parent.finished and all(f.finished for f in parent.forks):
            self._leave(parent, reason)

    def _leave(self, req: Request, reason: FinishReason, keep_state: bool = True) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if req.forks:  # a parent's state is a fork source, never a checkpoint of its own
            self.cache_manager.release(req)
        else:
            completed = keep_state and reason in (FinishReason.STOP, FinishReason.LENGTH)
            self.cache_manager.finish(req, completed=completed)
        self.encoder.release(req)
        self.speculator.release(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self._released.append(req.request_id)
        self.requests.pop(req.request_id, None)
        self._copied_from(req)

    def _copied_from(self, fork: Request) -> None:
        """`fork` no longer needs its parent's state; the parent's slot and pages go back once
        none of its forks does."""
        source, fork.source = fork.source, None
        if source is not None and copied_by_all(source):
            self.cache_manager.release(source)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Decode first: every running request one token past its prompt gets its token; then
        prompts (running chunks, then admissions) share what is left of the budget, capped at
        `max_prefill_tokens_while_decoding` when anything decodes, so a stream's inter-token gap
        is one decode step plus at most that many prompt tokens, whatever arrives."""
        self.cache_manager.evict_idle()
        self.rows.grammar.prune(self.requests)
        chunks: dict[str, SeqChunk] = {}
        copies = StepCopies()
        budget = self.cfg.max_num_batched_tokens
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        self.speculator.prepare(decoding, budget - 1, self.cfg.max_model_len, len(self.running))
        budget -= self._grow(decoding, budget, chunks, copies)
        cap = self.cfg.max_prefill_tokens_while_decoding
        prefill = min(budget, cap) if chunks and cap else budget
        prompts = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        prefill -= self._grow(prompts, prefill, chunks, copies)
        self._admit(prefill, chunks, copies)
        if not chunks:
            return None
        self._step_id += 1
        if self.rows.failed:
            self._drop_failed(chunks)
            if not chunks:  # NOTE: releases and images wait for a plan the ranks will get
                return StepPlan(self._step_id, ())
        order = [r.request_id for r in self.running if r.request_id in chunks]
        encoder_inputs, encoder_frees = self.encoder.take()
        released, self._released = tuple(self._released), []
        return StepPlan(
            self._step_id,
            tuple(chunks[rid] for rid in order),
            copies_after=copies.planned(copies.after, chunks),
            copies_before=copies.planned(copies.before, chunks),
            page_copies=copies.planned_pages(chunks),
            encoder_inputs=encoder_inputs,
            encoder_frees=encoder_frees,
            released=released,
        )

    def _drop_failed(self, chunks: dict[str, SeqChunk]) -> None:
        """Requests whose grammar could not give a row its mask leave with an error (slot,
        pages and checkpoints freed; the engine reports them: `take_failed`) and their chunks
        leave the plan, a forking parent's too once none of its forks is left."""
        for req, _ in self.rows.failed.values():
            if not req.finished:
                self.finish(req, FinishReason.ERROR)
        for rid in [rid for rid in chunks if rid not in self.requests]:
            del chunks[rid]

    def take_failed(self) -> list[tuple[Request, str]]:
        """The requests `schedule` failed since the last call, and why."""
        return self.rows.take_failed()

    def _grow(
        self, reqs: list[Request], budget: int, chunks: dict[str, SeqChunk], copies: StepCopies
    ) -> int:
        """Plan the next chunk of each running request in `reqs` within `budget`, preempting
        the latest admitted request when pages run out; returns the budget taken (tokens, and
        the encoder work of images: `EncoderPlanner.fit`)."""
        used = 0
        for req in reqs:
            while req.status is Status.RUNNING and used < budget:
                n = min(req.num_tokens - req.num_computed, budget - used)
                draft = self._draft(req, budget - used - n) if n == 1 else ()
                if draft and self.cache_manager.grow(req, req.num_computed + 1 + len(draft)):
                    chunks[req.request_id] = self._verify_chunk(req, draft)
                    used += 1 + len(draft)
                    break
                n, cost = self._fit(req, n, budget - used)
                if self.cache_manager.grow(req, req.num_computed + n):
                    chunks[req.request_id] = self._chunk(req, n, copies)
                    used += cost
                    break
                victim = self.running[-1]  # NOTE: may be `req` itself: then it waits
                self._preempt(victim)
                chunks.pop(victim.request_id, None)
        return used

    def _admit(self, budget: int, chunks: dict[str, SeqChunk], copies: StepCopies) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if req.source is not None:  # a fork: a copy of its parent's state (or it waits)
                n = self.cache_manager.fork(req, req.source, budget, copies)
            else:
                n = self.cache_manager.admit(req, budget, copies)
            if not n:
                break
            n, cost = self._fit(req, n, budget)
            req.status = Status.RUNNING
            self.waiting.popleft()
            self.running.append(req)
            chunks[req.request_id] = self._chunk(req, n, copies)
            budget -= cost
            self._copied_from(req)

    def _fit(self, req: Request, n: int, budget: int) -> tuple[int, int]:
        """(tokens, budget taken) of req's next chunk of at most n tokens."""
        if not req.images:
            return n, n
        return self.encoder.fit(req, req.num_computed, n, budget)

    def _chunk(self, req: Request, n: int, copies: StepCopies) -> SeqChunk:
        start = req.num_computed
        sampling = None
        fork_rows: tuple[tuple[str, SamplingRow], ...] = ()
        # The chunk ends the prompt (or is a decode step); a parent's forks sample, not it.
        if start + n == req.num_tokens:
            if req.forks:
                fork_rows = self._fork_rows(req)
            else:
                sampling = self.rows.row(req)
        return SeqChunk(
            request_id=req.request_id,
            token_ids=tuple(req.all_token_ids[start : start + n]),
            start_pos=start,
            slot=req.slot,  # type: ignore[arg-type]
            block_table=tuple(req.pages),
            sampling=sampling,
            checkpoints=self.cache_manager.plan_checkpoints(req, start, n, copies),
            window_tables=tuple(tuple(t) for t in req.window_pages),
            images=self.encoder.chunk_images(req, start, n) if req.images else (),
            fork_rows=fork_rows,
            lora_slot=req.lora_slot,
        )

    def _fork_rows(self, parent: Request) -> tuple[tuple[str, SamplingRow], ...]:
        """(fork id, row) of each unfinished fork of `parent`, one whose grammar failed left
        out (it leaves before the plan is built: `_drop_failed`)."""
        rows = [(f.request_id, self.rows.row(f)) for f in parent.forks if not f.finished]
        return tuple((rid, row) for rid, row in rows if rid not in self.rows.failed)

    # ---- speculative decoding -------------------------------------------------------------
    def _draft(self, req: Request, room: int) -> tuple[int, ...]:
        """A decoding request's proposals this step (engine.speculation), at most one per
        spec slot it holds."""
        k = self.speculator.limit(req, room, self.cfg.max_model_len, len(self.running))
        if k < 1:
            return ()
        k = len(self.cache_manager.spec_slots(req, k))
        draft = self.speculator.propose(req, k)
        if draft and req.params.grammar is not None:
            draft = draft[: self.rows.allowed_draft(req, draft)]
        return draft

    def _verify_chunk(self, req: Request, draft: tuple[int, ...]) -> SeqChunk:
        """req's last token then its proposals, one sampling row per position; the state after
        each of its first k tokens goes to a spec slot (the rollback selects one)."""
        start, k = req.num_computed, len(draft)
        rows = self.rows.rows(req, draft)
        assert req.slot is not None  # a running request holds its slot
        return SeqChunk(
            request_id=req.request_id,
            token_ids=(req.all_token_ids[start], *draft),
            start_pos=start,
            slot=req.slot,
            block_table=tuple(req.pages),
            sampling=rows[k],
            checkpoints=tuple((j, req.spec_slots[j - 1]) for j in range(1, k + 1)),
            window_tables=tuple(tuple(t) for t in req.window_pages),
            draft_rows=tuple(rows[:k]),
            draft_probs=self.speculator.draft_probs(req, k),
            lora_slot=req.lora_slot,
        )

    def _preempt(self, req: Request) -> None:
        """Free everything and recompute later from prompt + generated tokens."""
        self.running.remove(req)
        self._released.append(req.request_id)
        self.cache_manager.forget(req)
        self.encoder.release(req)
        self.speculator.release(req)
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # ---- results ------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Advance requests by the executed plan; returns requests that got new tokens (a
        verify row's accepted run, cut at the first stop: `Request.num_new_tokens`)."""
        verifying: dict[str, SeqChunk] = {}
        for chunk in plan.seqs:
            req = self.requests.get(chunk.request_id)
            if req is not None and req.status is Status.RUNNING:
                if chunk.num_draft:  # advanced by what it accepts, below
                    verifying[req.request_id] = chunk
                    continue
                req.num_computed += chunk.num_tokens
                self.cache_manager.commit_checkpoints(req)
                if ready_to_fork(req):
                    self._fork(req)
        updated: list[Request] = []
        for rid, samples in _by_request(result):
            req = self.requests.get(rid)
            # NOTE: a fork's first token comes while it waits for a slot (its parent sampled it).
            if req is None or req.status not in (Status.RUNNING, Status.WAITING):
                continue  # aborted while the step ran
            verify = verifying.get(rid)
            if verify is not None:
                drawn = [tok for tok, _, _ in samples]
                samples = samples[: self.speculator.accept(req, verify.token_ids[1:], drawn)]
            reason = self._append(req, samples)
            if verify is not None:
                kept = req.num_new_tokens  # tokens of the row folded into the state
                self.cache_manager.rollback(req, verify.start_pos, kept, verify.num_tokens)
            if reason is not None:
                self.finish(req, reason)
            updated.append(req)
        return updated

    def _append(self, req: Request, samples: list[_Sample]) -> FinishReason | None:
        """Append tokens in order until one ends the request (EOS, a stop id, max_tokens, the
        model length): output ends where decoding one token a step ends."""
        req.num_new_tokens = 0
        for tok, lp, top in samples:
            req.output_token_ids.append(tok)
            req.output_logprobs.append(lp)
            req.output_top_logprobs.append(top)
            req.num_new_tokens += 1
            reason = self._stop_reason(req, tok)
            if reason is not None:
                return reason
        return None

    def _stop_reason(self, req: Request, tok: int) -> FinishReason | None:
        p = req.params
        if (not p.ignore_eos and tok in self.cfg.eos_token_ids) or tok in p.stop_token_ids:
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            return FinishReason.LENGTH
        return None


_Sample = tuple[int, float | None, list[tuple[int, float]] | None]


def _by_request(result: StepResult) -> Iterator[tuple[str, list[_Sample]]]:
    """The result's samples grouped by request, in order (a verify row's are consecutive)."""
    rows = zip(
        result.request_ids, result.token_ids, result.logprobs, result.top_logprobs, strict=True
    )
    for rid, group in groupby(rows, key=lambda r: r[0]):
        yield rid, [(tok, lp, top) for _, tok, lp, top in group]
