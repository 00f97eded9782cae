"""Continuous batching: admit, chunk, preempt and release, one StepPlan per step (pure Python)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.cached_sessions import CachedSessions
from shortconv.cache.prefix_cache import PrefixCache
from shortconv.cache.prefix_reuse import Copy, PrefixReuse
from shortconv.cache.sessions import Checkpoint, SessionStore
from shortconv.engine.plan import SeqChunk, StepPlan, StepResult
from shortconv.engine.request import Request, Status
from shortconv.sampling.sampler import SamplingRow


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


class Scheduler(PrefixReuse):
    """Owns slots and pages. Every exit path (finish, abort, preempt) releases both.
    Prefix caching (`cfg.enable_prefix_caching`) is the `PrefixReuse` half."""

    def __init__(self, cfg: SchedulerConfig, slots: SlotAllocator, pages: PageAllocator):
        self.cfg = cfg
        self.slots, self.pages = slots, pages
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.cache: PrefixCache | None = None
        self.sessions: SessionStore | CachedSessions
        if cfg.enable_prefix_caching:
            # With the cache a session is a hint on top of it: pins and TTL, no state of its own.
            self.sessions = CachedSessions(cfg.session_ttl_s)
            self.cache = PrefixCache(cfg.page_size, slots, pages, self.sessions.entry_evicted)
        else:
            self.sessions = SessionStore(slots, pages, cfg.session_ttl_s)
        self._step_id = 0

    # ---- queue management -------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.finish(req, "abort")
        return req

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        if reason in ("stop", "length") and req.slot is not None:
            if self.cache is not None:
                self._cache_generation(req)
            elif req.session_id is not None:
                self._keep_session(req)
        self._release(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.requests.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        self.sessions.evict_idle()
        budget = self.cfg.max_num_batched_tokens
        chunks: dict[str, SeqChunk] = {}
        copies: list[Copy] = []  # after the forward
        before: list[Copy] = []  # slot copies before it
        page_copies: list[Copy] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._ensure_pages(req, req.num_computed + n, evict=True):
                victim = self.running[-1]
                self._preempt(victim)
                chunks.pop(victim.request_id, None)
                continue  # retry the same index (or stop if the victim was this request)
            chunks[req.request_id] = self._chunk(req, n, copies)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            self._maybe_resume(req)
            resumed = self._resume_from_cache(req)
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._admit(req, n):
                break
            if resumed is not None:
                before.append(resumed[0])
                page_copies.extend(resumed[1:])
            self._count_lookup(req)
            self.waiting.popleft()
            self.running.append(req)
            chunks[req.request_id] = self._chunk(req, n, copies)
            budget -= n
        if not chunks:
            return None
        self._step_id += 1
        order = [r.request_id for r in self.running if r.request_id in chunks]

        # A preempted request's copies must not run: its slots were freed (and maybe reused).
        def kept(cs: list[Copy]) -> tuple[tuple[int, int], ...]:
            return tuple((src, dst) for rid, src, dst in cs if rid in chunks)

        return StepPlan(
            self._step_id,
            tuple(chunks[rid] for rid in order),
            copies_after=kept(copies),
            copies_before=kept(before),
            page_copies=kept(page_copies),
        )

    def _chunk(self, req: Request, n: int, copies: list[Copy]) -> SeqChunk:
        start = req.num_computed
        ends_prompt = start + n == req.num_tokens
        sampling = (
            SamplingRow(req.params, req.seed, len(req.output_token_ids)) if ends_prompt else None
        )
        if self.cache is not None:
            inside = self._plan_checkpoints(req, start, n, copies)
        else:
            inside = ()
            if ends_prompt and req.session_id is not None and not req.output_token_ids:
                self._snapshot_prompt(req, copies)
        return SeqChunk(
            request_id=req.request_id,
            token_ids=tuple(req.all_token_ids[start : start + n]),
            start_pos=start,
            slot=req.slot,  # type: ignore[arg-type]
            block_table=tuple(req.pages),
            sampling=sampling,
            checkpoints=inside,
        )

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cfg.page_size)

    def _ensure_pages(self, req: Request, num_tokens: int, evict: bool) -> bool:
        """Grow req's pages to cover num_tokens, evicting idle kept sessions (LRU) if allowed."""
        extra = self._pages_for(num_tokens) - len(req.pages)
        if extra <= 0:
            return True
        got = self.pages.alloc(extra)
        while got is None and evict and self._evict("page"):
            got = self.pages.alloc(extra)
        if got is None:
            return False
        req.pages.extend(got)
        return True

    def _alloc_slot(self) -> int | None:
        slot = self.slots.alloc()
        while slot is None and self._evict("slot"):
            slot = self.slots.alloc()
        return slot

    def _evict(self, need: str) -> bool:
        """Free one cached entry (prefix cache) or kept session (LRU) for a live request."""
        if self.cache is not None:
            return self.cache.evict(need)
        return self.sessions.evict_lru()

    def _admit(self, req: Request, n: int) -> bool:
        if req.slot is None:
            req.slot = self._alloc_slot()
            if req.slot is None:
                return False
        if not self._ensure_pages(req, req.num_computed + n, evict=True):
            # NOTE: a resumed session keeps its slot and pages while it waits (its kept state
            # must not be lost); a fresh one gives its new slot back, and one resumed from the
            # prefix cache gives everything back (the cache still holds what it copied).
            if self.cache is not None:
                self._forget_resume(req)
            elif not req.num_cached_tokens:
                self.slots.free(req.slot)
                req.slot = None
            return False
        req.status = Status.RUNNING
        return True

    # ---- sessions ---------------------------------------------------------------------
    def _maybe_resume(self, req: Request) -> None:
        # NOTE: one lookup per request: a request that waits is not a new miss on every pass.
        if req.session_id is None or req.session_looked_up or self.cache is not None:
            return
        req.session_looked_up = True
        resume = self.sessions.take(req.session_id, req.prompt_token_ids)
        if resume is not None:
            req.slot, req.pages = resume.slot, resume.pages
            req.num_computed = req.num_cached_tokens = resume.num_tokens

    def _snapshot_prompt(self, req: Request, copies: list[Copy]) -> None:
        """Copy the slot's state at the end of this step into a spare slot (if one is free);
        share the prompt's KV pages with it."""
        spare = self.slots.alloc()
        if spare is None:
            return
        prompt_pages = req.pages[: self._pages_for(len(req.prompt_token_ids))]
        self.pages.share(prompt_pages)
        req.prompt_ckpt = Checkpoint(spare, tuple(req.prompt_token_ids), tuple(prompt_pages))
        copies.append((req.request_id, req.slot, spare))  # type: ignore[arg-type]

    def _keep_session(self, req: Request) -> None:
        gen = Checkpoint(req.slot, tuple(req.all_token_ids[: req.num_computed]), tuple(req.pages))  # type: ignore[arg-type]
        self.sessions.keep(req.session_id, gen, req.prompt_ckpt)  # type: ignore[arg-type]
        req.slot, req.pages, req.prompt_ckpt = None, [], None

    def _preempt(self, req: Request) -> None:
        """Free everything and recompute later from prompt + generated tokens."""
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        if not req.output_token_ids:
            req.num_cached_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        for _, slot in req.pending_ckpts:
            self.slots.free(slot)
        req.pending_ckpts.clear()
        req.prompt_entry = None
        if req.prompt_ckpt is not None:
            self.slots.free(req.prompt_ckpt.slot)
            self.pages.free(list(req.prompt_ckpt.pages))
            req.prompt_ckpt = None
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None
        if req.pages:
            self.pages.free(req.pages)
            req.pages = []

    # ---- results ------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Advance requests by the executed plan; returns requests that got a new token."""
        for chunk in plan.seqs:
            req = self.requests.get(chunk.request_id)
            if req is not None and req.status is Status.RUNNING:
                req.num_computed += chunk.num_tokens
                self._commit_checkpoints(req)
        updated: list[Request] = []
        for rid, tok, lp, top in zip(
            result.request_ids,
            result.token_ids,
            result.logprobs,
            result.top_logprobs,
            strict=True,
        ):
            req = self.requests.get(rid)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            req.output_token_ids.append(tok)
            req.output_logprobs.append(lp)
            req.output_top_logprobs.append(top)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self.finish(req, reason)
            updated.append(req)
        return updated

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if not p.ignore_eos and tok in self.cfg.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens:
            return "length"
        if req.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None
