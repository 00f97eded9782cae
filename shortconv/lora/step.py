"""How one step's token rows meet their adapters on the torch path: resolved once per step,
read by every layer. (The Triton path reads `lora.kernel.KernelRows` instead, and never
builds these.)

Two ways, picked per step (never per layer):

* **Stacked** (decode-sized steps): every layer runs one shrink of all rows against all its
  slots' A at once (rank-major, `LoraSlots.stacked`), zeroes each row's columns of the slots
  it does not use (`mask`), and one expand of the result into y. Three torch ops per layer,
  whatever the number of adapters; base rows cost only their share of two tiny GEMMs.
* **Grouped** (long steps, i.e. prefill): per adapter, the rows that use it, through two GEMMs
  sliced to the slot's rank, so a long base prompt beside one adapter row does not pay the
  adapter's GEMMs for every token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NO_ADAPTER = -1

# The stacked path computes every row against every slot: worth it while the rows are few
# (decode, where the per-adapter ops' dispatch cost, not the FLOPs, is what LoRA costs).
# At 8 rows x 4 rank-16 adapters it ran the adapters of an LFM2-350M decode step ~3x faster
# than the grouped path (docs/lora.md, Bench); 64 rows keeps prefill steps on the grouped path.
STACKED_MAX_ROWS = 64
# ... and while the slots it reads (every slot, at the step's largest rank) are at most this
# many times the rank the step's adapters really have: idle slots and rank padding are read too.
STACKED_MAX_WASTE = 4


@dataclass(frozen=True)
class LoraGroup:
    """The token rows (`rows`, int64 on the model's device) that use adapter `slot`."""

    slot: int
    rows: torch.Tensor


@dataclass(frozen=True)
class LoraStep:
    """One step's rows by adapter: `mask` set (stacked: [rows, rank * num_slots] bool, True
    where the column's slot is the row's own) or `groups` (grouped)."""

    rank: int = 0
    mask: torch.Tensor | None = None
    groups: tuple[LoraGroup, ...] = ()


def stack_columns(num_slots: int, rank: int) -> torch.Tensor:
    """The slot of each column of a stacked shrink: column rho * num_slots + s is slot s."""
    return torch.arange(num_slots, dtype=torch.int64).repeat(rank)


def step_rank(slots: Sequence[int], slot_ranks: Sequence[int]) -> int:
    """The largest rank among the adapters of rows `slots` (0: no row has one)."""
    return max((slot_ranks[s] for s in set(slots) - {NO_ADAPTER}), default=0)


def resolve_step(
    slots: Sequence[int], slot_ranks: Sequence[int], device: torch.device
) -> LoraStep | None:
    """The step for token rows whose adapter slots are `slots` (NO_ADAPTER: none); None when
    no row has an adapter of nonzero rank (every layer is then its base alone)."""
    rank = step_rank(slots, slot_ranks)
    if rank == 0:
        return None
    used = sorted(set(slots) - {NO_ADAPTER})
    ids = torch.tensor(slots, dtype=torch.int64)
    needed = sum(slot_ranks[s] for s in used)
    if len(slots) <= STACKED_MAX_ROWS and rank * len(slot_ranks) <= STACKED_MAX_WASTE * needed:
        mask = ids[:, None] == stack_columns(len(slot_ranks), rank)[None, :]
        return LoraStep(rank, mask=mask.to(device))
    groups = tuple(LoraGroup(s, torch.nonzero(ids == s).flatten().to(device)) for s in used)
    return LoraStep(rank, groups=groups)
