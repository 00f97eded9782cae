"""Kept session state: resume a session's next turn from its last turn's slots and KV pages.

Each session keeps up to two checkpoints of the same conversation:
  * `gen`: the state at the end of generation (prompt + answer tokens, minus the last sampled
    token, which was never fed back) in the request's own slot and pages;
  * `prompt`: the state at the end of the prompt, copied into a spare slot in the step that
    finished the prompt; its KV pages are shared (refcounted), not copied.
A next turn resumes from whichever checkpoint's tokens prefix its prompt (gen first), so a chat
template that re-renders the previous answer differently still resumes from the prompt. Only
one turn of a session runs at a time, so the two checkpoints never both grow.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from shortconv.cache.allocators import PageAllocator, SlotAllocator


@dataclass(frozen=True)
class Checkpoint:
    slot: int
    token_ids: tuple[int, ...]
    pages: tuple[int, ...]


@dataclass
class KeptSession:
    gen: Checkpoint | None
    prompt: Checkpoint | None
    last_used: float


@dataclass(frozen=True)
class Resume:
    """What a new turn takes over: a slot whose state covers `num_tokens`, and its pages."""

    slot: int
    num_tokens: int
    pages: list[int]


class SessionStore:
    def __init__(self, slots: SlotAllocator, pages: PageAllocator, ttl_s: float = 600.0):
        self.slots, self.pages, self.ttl_s = slots, pages, ttl_s
        self._kept: OrderedDict[str, KeptSession] = OrderedDict()  # LRU first
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._kept

    def keep(self, session_id: str, gen: Checkpoint | None, prompt: Checkpoint | None) -> None:
        """Take ownership of the checkpoints (their slots and page references)."""
        old = self._kept.pop(session_id, None)
        if old is not None:
            self._release(old)
        if gen is None and prompt is None:
            return
        self._kept[session_id] = KeptSession(gen, prompt, time.monotonic())

    def take(self, session_id: str, prompt: list[int]) -> Resume | None:
        """Remove the session and return the checkpoint its new prompt extends, if any."""
        kept = self._kept.pop(session_id, None)
        if kept is None:
            self.misses += 1
            return None
        for mine, other in ((kept.gen, kept.prompt), (kept.prompt, kept.gen)):
            if mine is not None and _extends(prompt, mine.token_ids):
                if other is not None:
                    self._release_ckpt(other)
                self.hits += 1
                return Resume(mine.slot, len(mine.token_ids), list(mine.pages))
        self._release(kept)
        self.misses += 1
        return None

    def evict_lru(self) -> bool:
        if not self._kept:
            return False
        _, kept = self._kept.popitem(last=False)
        self._release(kept)
        self.evictions += 1
        return True

    def evict_idle(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        stale = [sid for sid, k in self._kept.items() if now - k.last_used > self.ttl_s]
        for sid in stale:
            self._release(self._kept.pop(sid))
        self.evictions += len(stale)
        return len(stale)

    def drop(self, session_id: str) -> None:
        kept = self._kept.pop(session_id, None)
        if kept is not None:
            self._release(kept)

    def session_ids(self) -> list[str]:
        return list(self._kept)

    def _release(self, kept: KeptSession) -> None:
        for ckpt in (kept.gen, kept.prompt):
            if ckpt is not None:
                self._release_ckpt(ckpt)

    def _release_ckpt(self, ckpt: Checkpoint) -> None:
        self.slots.free(ckpt.slot)
        if ckpt.pages:
            self.pages.free(list(ckpt.pages))


def _extends(prompt: list[int], kept: tuple[int, ...]) -> bool:
    # NOTE: strictly longer: the new turn must feed at least one token to get fresh logits.
    n = len(kept)
    return 0 < n < len(prompt) and tuple(prompt[:n]) == kept
