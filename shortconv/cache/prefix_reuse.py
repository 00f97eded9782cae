"""The scheduler's prefix-cache half: resume from the cache, plan checkpoints, insert them.

A request is looked up when it is admitted (again after a preemption); a hit gives it a fresh
slot with a copy of the checkpointed state (`copies_before`), a reference on every full cached
page, and a copy of a partly filled last page (`page_copies`), so nothing the cache holds is
ever written by a request. While a prompt is prefilled, its state is checkpointed every
`checkpoint_interval` tokens and at its end (`SeqChunk.checkpoints` inside a chunk,
`copies_after` at a chunk's end) into slots of its own, inserted into the cache once the step
has run. A finished request hands its slot to the cache as the end-of-generation checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shortconv.cache.prefix_cache import PrefixCache
from shortconv.engine.request import Request

if TYPE_CHECKING:
    from shortconv.cache.allocators import PageAllocator, SlotAllocator
    from shortconv.cache.cached_sessions import CachedSessions
    from shortconv.cache.sessions import SessionStore
    from shortconv.engine.scheduler import SchedulerConfig

Copy = tuple[str, int, int]  # (request id, src, dst): kept only while its request is planned


class PrefixReuse:
    """Mixed into `Scheduler` (whose `_alloc_slot`, `_ensure_pages` and `_release` it uses);
    every method is a no-op unless prefix caching is on."""

    cfg: SchedulerConfig
    cache: PrefixCache | None
    sessions: SessionStore | CachedSessions
    slots: SlotAllocator
    pages: PageAllocator

    # ---- resume ---------------------------------------------------------------------------
    def _resume_from_cache(self, req: Request) -> tuple[Copy, ...] | None:
        """Take over the longest cached prefix of a request that holds nothing yet: returns
        its slot copy and (mid-page) page copy, or None (no hit, or no room: run it fresh)."""
        cache = self.cache
        if cache is None or req.slot is not None or req.num_computed:
            return None
        hit = cache.match(req.all_token_ids)
        if hit is None:
            return None
        # NOTE: take the page references first: the allocations below may evict the entry.
        req.pages = list(hit.full_pages)
        self.pages.share(req.pages)
        req.slot = self._alloc_slot()  # type: ignore[attr-defined]
        if req.slot is None:
            self._forget_resume(req)
            return None
        copies: tuple[Copy, ...] = ((req.request_id, hit.slot, req.slot),)
        if hit.partial_page is not None:  # one fresh page for the copy of the partial one
            if not self._ensure_pages(req, hit.num_tokens, evict=True):  # type: ignore[attr-defined]
                self._forget_resume(req)
                return None
            copies += ((req.request_id, hit.partial_page, req.pages[-1]),)
        req.num_computed = hit.num_tokens
        if not req.output_token_ids:
            req.num_cached_tokens = min(hit.num_tokens, len(req.prompt_token_ids))
        return copies

    def _forget_resume(self, req: Request) -> None:
        """Give back what a resume (or a failed admission) took; the request starts over."""
        self._release(req)  # type: ignore[attr-defined]
        req.num_computed = 0
        if not req.output_token_ids:
            req.num_cached_tokens = 0

    def _count_lookup(self, req: Request) -> None:
        """Count an admitted request's lookup (a request that waits is not counted per pass)."""
        if self.cache is None or req.session_looked_up:
            return
        req.session_looked_up = True
        counters = self.cache.counters
        counters.query_tokens += len(req.prompt_token_ids)
        counters.hit_tokens += req.num_cached_tokens
        if req.session_id is not None:
            self.sessions.lookup(req.session_id, req.num_cached_tokens)  # type: ignore[union-attr]

    # ---- checkpoints ----------------------------------------------------------------------
    def _plan_checkpoints(
        self, req: Request, start: int, n: int, copies: list[Copy]
    ) -> tuple[tuple[int, int], ...]:
        """Checkpoints of the prompt positions this chunk reaches: every interval and the end
        of the prompt. Inside the chunk they go in the chunk; at its end, in `copies` (after
        the forward). No free slot: fewer checkpoints, never a failed step."""
        end, plen, every = start + n, len(req.prompt_token_ids), self.cfg.checkpoint_interval
        wanted = set(range((start // every + 1) * every, min(end, plen) + 1, every))
        if start < plen <= end:
            wanted.add(plen)
        inside: list[tuple[int, int]] = []
        for q in sorted(wanted):
            slot = self._checkpoint_slot()
            if slot is None:
                break
            req.pending_ckpts.append((q, slot))
            if q == end:
                copies.append((req.request_id, req.slot, slot))  # type: ignore[arg-type]
            else:
                inside.append((q - start, slot))
        return tuple(inside)

    def _checkpoint_slot(self) -> int | None:
        """A free slot, evicting only unpinned cached entries (a checkpoint is worth less than
        a session's kept state)."""
        assert self.cache is not None
        slot = self.slots.alloc()
        while slot is None and self.cache.evict("slot", allow_pinned=False):
            slot = self.slots.alloc()
        return slot

    def _commit_checkpoints(self, req: Request) -> None:
        """After the step ran: insert the checkpoints it wrote into the cache."""
        if self.cache is None or not req.pending_ckpts:
            return
        plen = len(req.prompt_token_ids)
        for q, slot in req.pending_ckpts:
            # NOTE: checkpoints are at prompt positions only (q <= len(prompt)).
            entry = self.cache.insert(req.prompt_token_ids[:q], req.pages, slot)
            if q == plen and req.session_id is not None:
                req.prompt_entry = entry
        req.pending_ckpts.clear()

    def _cache_generation(self, req: Request) -> None:
        """A finished request's slot becomes the end-of-generation checkpoint (no copy); its
        page references are released by the caller, the cache keeps its own."""
        assert self.cache is not None and req.slot is not None
        n = req.num_computed
        if n == 0:
            return
        entry = self.cache.insert(req.all_token_ids[:n], req.pages, req.slot)
        req.slot = None
        if req.session_id is not None:
            kept = [entry] if req.prompt_entry is None else [entry, req.prompt_entry]
            self.sessions.keep(req.session_id, kept)  # type: ignore[arg-type]

    def flush_prefix_cache(self) -> int:
        """Drop every cached entry (kept sessions included); returns how many."""
        return self.cache.flush() if self.cache is not None else 0
