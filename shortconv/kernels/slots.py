"""State slots of a batch, for the torch kernels: which rows are live, a safe index for every
row, and a host-sync-free scatter of new states back into the pool.

A row whose cache index equals `pad_slot_id` is a pad row: it reads no slot (its gathers use
slot 0, whose values are then masked out) and writes none.
"""

from __future__ import annotations

import torch


def live_slots(
    cache_indices: torch.Tensor, pad_slot_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots int64 [B], live bool [B], safe int64 [B]): safe is slots with pad rows at 0."""
    slots = cache_indices.to(device=device, dtype=torch.int64)
    live = slots != pad_slot_id
    return slots, live, torch.where(live, slots, torch.zeros_like(slots))


def scatter_states(
    states: torch.Tensor,
    slots: torch.Tensor,
    live: torch.Tensor,
    new_states: torch.Tensor,
) -> None:
    """states[slots[b]] = new_states[b] for live rows only, without a host sync.

    Boolean-mask indexing would sync (data-dependent size), so every row writes somewhere:
    a pad row is redirected to the first live row's slot with that row's value, so duplicate
    indices always carry identical data and the result is order-independent. When no row is
    live, all rows rewrite slot 0 with its own current content, which is a no-op.
    """
    first_live = torch.argmax(live.to(torch.int32))
    any_live = live.any()
    rows = torch.arange(slots.numel(), device=slots.device)
    src_row = torch.where(live, rows, first_live)
    target = torch.where(any_live, slots[src_row], torch.zeros_like(slots))
    src = torch.where(any_live, new_states[src_row].to(states.dtype), states[target])
    states.index_copy_(0, target.to(torch.int64), src)


def all_live_cpu(slots: torch.Tensor, pad_slot_id: int) -> bool:
    """True when every row is a live request (slot > 0: neither scratch nor pad) on CPU.

    NOTE: on CPU a host read is no device sync and nothing is being captured, so the decode
    kernels check this once and skip the pad-row masking (a dozen ops per layer, a tenth of a
    small model's decode step). Live rows of one step never share a slot, so a plain
    index_copy_ is then deterministic.
    """
    return slots.device.type == "cpu" and pad_slot_id <= 0 and bool((slots > 0).all())
