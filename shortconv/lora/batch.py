"""The step's LoRA rows: which adapter slot each token row uses, set once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shortconv.engine.plan import StepPlan

NO_ADAPTER = -1


@dataclass(frozen=True)
class LoraGroup:
    """The token rows (`rows`, int64 on the model's device) that use adapter `slot`."""

    slot: int
    rows: torch.Tensor


class LoraBatch:
    """One per model (shared by every LoRA layer, made when methods are bound): the runner
    sets it from the plan once per step, before the forward; layers only read it.

    Eager steps read `groups`: rows with no adapter are in no group, so they pay nothing; a
    step with none has no groups, and every LoRA layer is its base method alone.

    Graph steps (`graphed`, on only inside the graph runner's captured region) read
    `token_slots` instead: a static buffer (`reserve`), each token row's slot, in place every
    step, with rows that have no adapter (and a bucket's pad rows) at `zero_slot`, a slot
    every layer keeps all zero. Its shape never changes, so a captured graph reads it.

    NOTE: `zero_slot` is `max_loras`: layers hold `max_loras + 1` slots."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.zero_slot = max_loras
        self.groups: tuple[LoraGroup, ...] = ()
        self.graphed = False
        self.token_slots: torch.Tensor | None = None

    def reserve(self, num_tokens: int, device: torch.device) -> None:
        """Allocate `token_slots` for up to `num_tokens` rows (the graph runner, at build)."""
        self.token_slots = torch.full((num_tokens,), self.zero_slot, dtype=torch.int64)
        self.token_slots = self.token_slots.to(device)

    def begin_step(self, plan: StepPlan, device: torch.device) -> None:
        """The plan's token rows (its chunks' tokens, in order) by adapter slot."""
        slots = [c.lora_slot for c in plan.seqs for _ in c.token_ids]
        self.set_rows(slots, device)

    def set_rows(self, slots: list[int], device: torch.device) -> None:
        self._set_static(slots)
        if all(s == NO_ADAPTER for s in slots):
            self.groups = ()
            return
        ids = torch.tensor(slots, dtype=torch.int64)
        self.groups = tuple(
            LoraGroup(s, torch.nonzero(ids == s).flatten().to(device))
            for s in sorted(set(slots) - {NO_ADAPTER})
        )

    def _set_static(self, slots: list[int]) -> None:
        """Fill `token_slots` in place (pad rows past the plan's: the zero slot). A step
        longer than the buffer never replays a graph, so it is left as is."""
        buf = self.token_slots
        if buf is None or len(slots) > buf.numel():
            return
        host = torch.full((buf.numel(),), self.zero_slot, dtype=torch.int64)
        host[: len(slots)] = torch.tensor(
            [self.zero_slot if s == NO_ADAPTER else s for s in slots], dtype=torch.int64
        )
        buf.copy_(host, non_blocking=True)
