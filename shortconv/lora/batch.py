"""The step's LoRA rows: which adapter slot each token row uses, grouped once per step."""

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
    sets it from the plan once per step, before the forward; layers only read `groups`.

    NOTE: rows with no adapter are in no group, so they pay nothing; a step with none has
    no groups, and every LoRA layer is its base method alone."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.groups: tuple[LoraGroup, ...] = ()

    def begin_step(self, plan: StepPlan, device: torch.device) -> None:
        """Group the plan's token rows (its chunks' tokens, in order) by adapter slot."""
        slots = [c.lora_slot for c in plan.seqs for _ in c.token_ids]
        self.set_rows(slots, device)

    def set_rows(self, slots: list[int], device: torch.device) -> None:
        if all(s == NO_ADAPTER for s in slots):
            self.groups = ()
            return
        ids = torch.tensor(slots, dtype=torch.int64)
        self.groups = tuple(
            LoraGroup(s, torch.nonzero(ids == s).flatten().to(device))
            for s in sorted(set(slots) - {NO_ADAPTER})
        )
