"""Host-side bookkeeping for state slots and KV pages (pure Python, owned by the scheduler).

Slot/page ids chosen here are sent in every StepPlan and are the same on every TP rank, so the
device tensors (`StatePool`) never need their own bookkeeping.
"""

from __future__ import annotations

SCRATCH_SLOT = 0
SCRATCH_PAGE = 0


class AllocatorError(RuntimeError):
    """A broken invariant (double free, foreign id): a bug, never a user error."""


class SlotAllocator:
    """Hands out state slots 1..num_slots-1; slot 0 is the scratch slot no request owns."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"need at least 2 state slots (1 scratch + 1 live), got {num_slots}")
        self.num_slots = num_slots
        # NOTE: LIFO reuse keeps recently used slots (and their cache lines) hot.
        self._free: list[int] = list(range(num_slots - 1, SCRATCH_SLOT, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise AllocatorError(f"free of slot {slot} that is not allocated (double free?)")
        self._used.remove(slot)
        self._free.append(slot)


class PageAllocator:
    """Reference-counted KV pages 1..num_pages-1; page 0 is the scratch page.

    A page is shared (refcount > 1) when a kept session checkpoint and a live request both cover
    the same prefix; it returns to the free list when the last holder releases it.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"need at least 2 KV pages (1 scratch + 1 live), got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._refs: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        """All-or-nothing: n fresh pages, or None when fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._refs:
                raise AllocatorError(f"share of page {p} that is not allocated")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            refs = self._refs.get(p)
            if refs is None:
                raise AllocatorError(f"free of page {p} that is not allocated (double free?)")
            if refs == 1:
                del self._refs[p]
                self._free.append(p)
            else:
                self._refs[p] = refs - 1

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)
