"""One owner of state slots, KV pages, prefix checkpoints and session pins; the scheduler asks it.

A request resumes from a checkpoint in the `PrefixCache` tree by a copy: the checkpointed state
into a fresh slot (`copies_before`), a reference on every full cached page and a copy of a partly
filled last page (`page_copies`), so nothing the tree holds is ever written by a request. An
`n > 1` fork is the same copy, from its parent's live state instead of a tree entry (`fork`).
While a prompt is prefilled its state is checkpointed into slots of its own (`SeqChunk.checkpoints`
inside a chunk, `copies_after` at a chunk's end), inserted into the tree once the step has run; a
request that completes hands its slot to the tree as its end-of-generation checkpoint. A session is
a pin on its latest two (`sessions.py`).

With prefix caching every request is looked up, every prompt checkpointed each
`checkpoint_interval` tokens and at its end, every generation kept, and an entry nothing pins
stays as an LRU entry. Without it the same tree holds sessions' checkpoints only: a session's
request alone is looked up (among its own pins) and checkpointed (end of prompt, end of
generation), and an entry is dropped as soon as nothing pins it.

KV pages come in groups (`kv_groups`): group 0 holds every full-attention layer's pages and
each sliding-window group its own (`window_pages`); a request holds one page list per group,
indexed alike, and a checkpoint keeps its windows' pages next to its slot.

NOTE: `grow` is the one place a request gains KV pages, and where a sliding group's pages leave
once they are wholly before the window of the request's next chunk; `release` is the one place
a request loses all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.page_tables import PageCopy, PageTables
from shortconv.cache.prefix_cache import CacheEntry, CacheHit, PrefixCache
from shortconv.cache.sessions import SessionPins
from shortconv.cache.window_pages import WindowGroup, window_span

Copy = tuple[str, int, int]  # (request id, src, dst)


class Holder(Protocol):
    """What the manager reads and writes on a request (`engine.request.Request` is one)."""

    request_id: str
    session_id: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    slot: int | None
    pages: list[int]  # KV group 0 (full attention)
    window_pages: list[list[int]]  # one list per sliding-window group, scratch 0 behind it
    num_computed: int  # tokens folded into the slot's state and the KV pages
    num_cached_tokens: int  # prompt tokens resumed from a checkpoint
    looked_up: bool  # the lookup is counted once, at the first admission
    pending_ckpts: list[tuple[int, int]]  # (position, slot) the running step writes
    spec_slots: list[int]  # speculation: the state after each verified position
    prompt_entry: CacheEntry | None  # the end-of-prompt checkpoint a session pins

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def prompt_key_ids(self) -> list[int]: ...  # the tree's key: images as digests (engine.images)

    @property
    def all_key_ids(self) -> list[int]: ...


@dataclass
class StepCopies:
    """One step's slot and page copies; each goes in the plan only while its request does (a
    preempted request's slots were freed, maybe handed out again)."""

    before: list[Copy] = field(default_factory=list)  # checkpoint -> a resuming request's slot
    pages: list[PageCopy] = field(default_factory=list)  # a partly filled cached page, on write
    after: list[Copy] = field(default_factory=list)  # a chunk's end state -> checkpoint slot

    @staticmethod
    def planned(group: list[Copy], planned: Container[str]) -> tuple[tuple[int, int], ...]:
        return tuple((src, dst) for rid, src, dst in group if rid in planned)

    def planned_pages(self, planned: Container[str]) -> tuple[tuple[int, int, int], ...]:
        return tuple((g, src, dst) for rid, g, src, dst in self.pages if rid in planned)


class CacheManager:
    def __init__(
        self,
        slots: SlotAllocator,
        pages: PageAllocator,
        page_size: int,
        *,
        prefix_caching: bool,
        checkpoint_interval: int,
        session_ttl_s: float,
        windows: Sequence[WindowGroup] = (),
    ) -> None:
        self.slots, self.pages, self.page_size = slots, pages, page_size
        self.windows = tuple(windows)  # the sliding-window KV groups, 1.. (group 0: `pages`)
        self.prefix_caching, self.checkpoint_interval = prefix_caching, checkpoint_interval
        # Set once by the engine when a session store is configured: spill(session_id) saves a
        # session's kept state before the cache evicts it for memory.
        self.spill: Callable[[str], None] | None = None
        self.tree = PrefixCache(
            page_size,
            slots,
            pages,
            lambda e: self.sessions.entry_evicted(e),
            self.windows,
            before_evict_pinned=self._spill_holders,
        )
        self.kv = PageTables(pages, self.windows, page_size, lambda need: self.tree.evict(need))
        self.sessions = SessionPins(session_ttl_s, self._let_go)

    # ---- admission ----------------------------------------------------------------------
    def admit(self, req: Holder, budget: int, copies: StepCopies) -> int:
        """Give a waiting request (it holds nothing) a slot and the pages of its next chunk,
        resuming it from the deepest usable checkpoint. Returns the chunk's tokens; 0: no room,
        and it holds nothing again (the tree still holds what a resume copied)."""
        slot_copy, page_copies = self._resume(req)
        n = min(len(req.all_token_ids) - req.num_computed, budget)
        if req.slot is None:
            req.slot = self._alloc_slot()
        if req.slot is None or not self.grow(req, req.num_computed + n):
            self.forget(req)
            return 0
        copies.before += slot_copy
        copies.pages += page_copies
        self._count_lookup(req)
        return n

    def _resume(self, req: Holder) -> tuple[tuple[Copy, ...], tuple[PageCopy, ...]]:
        """Take over a checkpoint: its slot copy and (mid-page) one page copy per KV group, or
        nothing (no hit, or no room: the request runs fresh)."""
        hit = self._lookup(req)
        if hit is None:
            return (), ()
        # NOTE: take the page references first: the allocations below may evict the entry.
        self.kv.share_hit(req, hit)
        req.slot = self._alloc_slot()
        # A mid-page hit: one fresh page per group for the copy of the partly filled one.
        if req.slot is None or (
            hit.partial_page is not None and not self.grow(req, hit.num_tokens)
        ):
            self.forget(req)
            return (), ()
        pages = self.kv.partial_copies(req, hit) if hit.partial_page is not None else ()
        req.num_computed = hit.num_tokens
        if not req.output_token_ids:
            req.num_cached_tokens = min(hit.num_tokens, len(req.prompt_token_ids))
        return ((req.request_id, hit.slot, req.slot),), pages

    def fork(self, req: Holder, source: Holder, budget: int, copies: StepCopies) -> int:
        """Admit a fork (it holds nothing; its first token is sampled) from its parent's
        computed prompt, as a hit resumes: the parent's slot copied into a fresh one, its full
        pages shared in every KV group and a partly filled last page copied. Returns the chunk's
        tokens (its first token, a decode row); 0: no slot or pages yet, and it holds nothing
        again (it waits; the parent keeps its state)."""
        hit = self._fork_point(source)
        self.kv.share_hit(req, hit)  # NOTE: references first: the allocations below may evict
        req.num_computed = hit.num_tokens
        req.slot = self._alloc_slot()
        n = min(len(req.all_token_ids) - hit.num_tokens, budget)
        if req.slot is None or not self.grow(req, hit.num_tokens):
            self.forget(req)
            return 0
        pages = self.kv.partial_copies(req, hit) if hit.partial_page is not None else ()
        if not self.grow(req, hit.num_tokens + n):
            self.forget(req)
            return 0
        copies.before.append((req.request_id, hit.slot, req.slot))
        copies.pages += pages
        req.looked_up = True  # the parent's lookup counted the prompt once
        return n

    def _fork_point(self, source: Holder) -> CacheHit:
        """The parent's computed state as a hit: its slot, its full pages, its partly filled
        last page and each sliding group's pages in the window (all live: a request frees only
        pages behind the window of the chunk it computes next)."""
        ps, q = self.page_size, source.num_computed
        assert source.slot is not None and q > 0
        spans = [window_span(q, g.window, ps) for g in self.windows]
        windows = tuple(
            tuple(t[s.start : s.stop]) for t, s in zip(source.window_pages, spans, strict=True)
        )
        # NOTE: no tree entry stands behind a fork; share_hit and partial_copies read none.
        entry = CacheEntry((), -1, None, 0, slot=source.slot)
        partial = source.pages[q // ps] if q % ps else None
        return CacheHit(q, source.slot, tuple(source.pages[: q // ps]), partial, entry, windows)

    def _lookup(self, req: Holder) -> CacheHit | None:
        if self.prefix_caching:
            return self.tree.match(req.all_key_ids)
        sid = req.session_id
        if sid is None or sid not in self.sessions:
            return None
        return self.tree.match(req.all_key_ids, lambda e: self.sessions.holds(sid, e))

    def _count_lookup(self, req: Holder) -> None:
        """Count an admitted request's lookup (a request that waits is not counted per pass)."""
        if req.looked_up:
            return
        req.looked_up = True
        self.tree.counters.query_tokens += len(req.prompt_token_ids)
        self.tree.counters.hit_tokens += req.num_cached_tokens
        if req.session_id is not None:
            self.sessions.lookup(req.session_id, req.num_cached_tokens)

    def forget(self, req: Holder) -> None:
        """Free everything req holds; it starts over (a failed admission, a preemption)."""
        self.release(req)
        req.num_computed = 0
        if not req.output_token_ids:
            req.num_cached_tokens = 0

    # ---- slots and pages ------------------------------------------------------------------
    def grow(self, req: Holder, num_tokens: int) -> bool:
        """Give req the pages to cover num_tokens in every KV group (all or none; see
        `PageTables.grow`: a sliding group's pages behind the window go back first)."""
        return self.kv.grow(req, num_tokens)

    def _alloc_slot(self) -> int | None:
        slot = self.slots.alloc()
        while slot is None and self.tree.evict("slot"):
            slot = self.slots.alloc()
        return slot

    def _checkpoint_slot(self) -> int | None:
        """A free slot, evicting only unpinned entries (a checkpoint is worth less than a
        session's)."""
        slot = self.slots.alloc()
        while slot is None and self.tree.evict("slot", allow_pinned=False):
            slot = self.slots.alloc()
        return slot

    # ---- speculative decoding ---------------------------------------------------------
    def spec_slots(self, req: Holder, k: int) -> tuple[int, ...]:
        """k slots of req's own that a verify row of k proposals writes the state after each
        of its first k tokens into, kept while it runs; fewer when the pool is short (the
        row then proposes fewer, never fails)."""
        while len(req.spec_slots) < k:
            slot = self._checkpoint_slot()
            if slot is None:
                break
            req.spec_slots.append(slot)
        return tuple(req.spec_slots[:k])

    def rollback(self, req: Holder, start: int, kept: int, verified: int) -> None:
        """After a verify row of `verified` tokens at `start`: keep its first `kept` tokens.

        NOTE: selection, not recompute: the state after j < verified tokens of the row is in
        `spec_slots[j - 1]` (written by the verify pass), so it becomes the live slot by a swap
        of slot ids; KV past the kept length is dead (the next row writes it before anything
        reads it) and pages that hold only rejected positions go back."""
        req.num_computed = start + kept
        if kept < verified:
            live, i = req.slot, kept - 1
            assert live is not None  # a verify row's request holds its slot
            req.slot, req.spec_slots[i] = req.spec_slots[i], live
        self.kv.trim(req, req.num_computed)

    # ---- checkpoints ----------------------------------------------------------------------
    def plan_checkpoints(
        self, req: Holder, start: int, n: int, copies: StepCopies
    ) -> tuple[tuple[int, int], ...]:
        """Checkpoints of the prompt positions this chunk reaches: every interval (prefix
        caching) and the end of the prompt (prefix caching, or a session). Inside the chunk
        they go in the chunk; at its end, in `copies.after`. No free slot: fewer checkpoints,
        never a failed step."""
        end, plen, every = start + n, len(req.prompt_token_ids), self.checkpoint_interval
        wanted: set[int] = set()
        if self.prefix_caching:
            wanted.update(range((start // every + 1) * every, min(end, plen) + 1, every))
        if start < plen <= end and (self.prefix_caching or req.session_id is not None):
            wanted.add(plen)
        inside: list[tuple[int, int]] = []
        for q in sorted(wanted):
            slot = self._checkpoint_slot()
            if slot is None:
                break
            req.pending_ckpts.append((q, slot))
            if q == end:
                copies.after.append((req.request_id, req.slot, slot))  # type: ignore[arg-type]
            else:
                inside.append((q - start, slot))
        return tuple(inside)

    def commit_checkpoints(self, req: Holder) -> None:
        """After the step ran: insert the checkpoints it wrote into the tree."""
        plen = len(req.prompt_token_ids)
        for q, slot in req.pending_ckpts:
            # NOTE: checkpoints are at prompt positions only (q <= len(prompt)).
            entry = self.tree.insert(req.prompt_key_ids[:q], req.pages, slot, req.window_pages)
            if q == plen and req.session_id is not None:
                req.prompt_entry = entry
        req.pending_ckpts.clear()

    # ---- leaving ------------------------------------------------------------------------
    def finish(self, req: Holder, completed: bool) -> None:
        """A request leaves. One that `completed` (stop or length) and is worth keeping (prefix
        caching, or a session's turn) hands its slot to the tree as the end-of-generation
        checkpoint (no copy), which its session pins with its end of prompt; everything else it
        holds is freed (the tree took its own page references)."""
        n = req.num_computed
        keep = self.prefix_caching or req.session_id is not None
        if completed and keep and req.slot is not None and n:
            entry = self.tree.insert(req.all_key_ids[:n], req.pages, req.slot, req.window_pages)
            req.slot = None
            if req.session_id is not None:
                self.sessions.keep(req.session_id, [entry, req.prompt_entry])
        self.release(req)

    def release(self, req: Holder) -> None:
        """Free everything req holds: slot, pages, checkpoint slots not written yet."""
        for _, slot in req.pending_ckpts:
            self.slots.free(slot)
        req.pending_ckpts.clear()
        if req.prompt_entry is not None:
            self._let_go(req.prompt_entry)
            req.prompt_entry = None
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None
        for slot in req.spec_slots:
            self.slots.free(slot)
        req.spec_slots.clear()
        self.kv.release(req)

    def _let_go(self, entry: CacheEntry) -> None:
        """An entry its holder let go: nothing else pinning it, it stays as an LRU entry with
        prefix caching and goes at once (slot and pages back) without."""
        if not self.prefix_caching and not entry.pins:
            self.tree.discard(entry)

    def _spill_holders(self, entry: CacheEntry) -> None:
        if self.spill is not None:
            for sid in self.sessions.holders(entry):
                self.spill(sid)

    def alloc_slot(self) -> int | None:
        """A free slot, evicting cached entries LRU (pinned last); None: none left."""
        return self._alloc_slot()

    # ---- upkeep -------------------------------------------------------------------------
    def evict_idle(self) -> int:
        """Unpin sessions idle past their TTL."""
        return self.sessions.evict_idle()

    def flush(self) -> int:
        """Drop every prefix-cache entry, sessions' too; returns how many. Without prefix
        caching there is none (sessions' checkpoints go with their sessions)."""
        return self.tree.flush() if self.prefix_caching else 0
