"""The draft model's per-request state: two slots and its KV pages, from pools of its own."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.execution.worker_spec import Capacity


@dataclass(frozen=True)
class DraftSeq:
    """One request in the draft. `slot` holds the committed state: the request's first
    `num_committed` tokens folded in, never one past its accepted ones; proposing runs on a
    copy of it in `scratch`. `pages`: one page list per KV group, all the same length."""

    slot: int
    scratch: int
    pages: tuple[tuple[int, ...], ...]
    num_committed: int = 0


class DraftPools:
    """The draft's slots and pages, handed out per request id and freed with the request."""

    def __init__(self, capacity: Capacity, page_size: int) -> None:
        self.slots = SlotAllocator(capacity.num_slots)
        self.pages = [PageAllocator(n) for n in capacity.pages_per_group]
        self.page_size = page_size
        self.seqs: dict[str, DraftSeq] = {}

    def reserve(self, request_id: str, num_positions: int) -> DraftSeq | None:
        """request_id's entry with pages for `num_positions` positions; None (nothing taken)
        when the pools cannot hold it: the request then proposes nothing this step."""
        seq = self.seqs.get(request_id) or self._new()
        if seq is None:
            return None
        want = -(-num_positions // self.page_size) - len(seq.pages[0])
        if want > 0:
            grown = [alloc.alloc(want) for alloc in self.pages]
            if any(g is None for g in grown):
                for alloc, got in zip(self.pages, grown, strict=True):
                    alloc.free(got or [])
                if request_id not in self.seqs:
                    self._release(seq)
                return None
            tables = (old + tuple(new or ()) for old, new in zip(seq.pages, grown, strict=True))
            seq = replace(seq, pages=tuple(tables))
        self.seqs[request_id] = seq
        return seq

    def commit(self, request_id: str, num_committed: int) -> None:
        self.seqs[request_id] = replace(self.seqs[request_id], num_committed=num_committed)

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._release(seq)

    def num_held(self) -> tuple[int, int]:
        """(slots, pages over every KV group) held by requests (the leak check reads it)."""
        return self.slots.num_used, sum(a.num_used for a in self.pages)

    def _new(self) -> DraftSeq | None:
        slot = self.slots.alloc()
        scratch = self.slots.alloc() if slot is not None else None
        if slot is None or scratch is None:
            if slot is not None:
                self.slots.free(slot)
            return None
        return DraftSeq(slot, scratch, tuple(() for _ in self.pages))

    def _release(self, seq: DraftSeq) -> None:
        self.slots.free(seq.slot)
        self.slots.free(seq.scratch)
        for alloc, table in zip(self.pages, seq.pages, strict=True):
            alloc.free(list(table))
