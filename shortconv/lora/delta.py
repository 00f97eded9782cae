"""The adapter product added into a base output, in place: y[t] += (x[t] A[s]^T) B[s]^T for
each token row t and its slot s, the two ways `lora.step` resolves a step into."""

from __future__ import annotations

import torch

from shortconv.lora.step import LoraGroup


def add_stacked(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor
) -> None:
    """y [T, out] += ((x A^T) * mask) B^T: x [T, in], `a` [C, in] and `b` [out, C] every slot's
    A and B stacked (LoraSlots.stacked), `mask` [T, C] True at the row's own slot's columns.

    NOTE: a masked-out column adds an exact 0.0, so a row sees only its own adapter; a base
    row's y is unchanged."""
    shrunk = x.to(a.dtype) @ a.t()
    shrunk.mul_(mask)
    y.addmm_(shrunk.to(y.dtype), b.t())


def add_grouped(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: list[int],
    groups: tuple[LoraGroup, ...],
) -> None:
    """y [T, out] += per group g: (x[g.rows] A[g.slot, :r]^T) B[g.slot, :, :r]^T, r the slot's
    rank: `a` [slots, max_rank, in], `b` [slots, out, max_rank] (LoraSlots.a / .b)."""
    for g in groups:
        r = ranks[g.slot]
        if r:
            xs = x.index_select(0, g.rows).to(a.dtype)
            delta = (xs @ a[g.slot, :r].t()) @ b[g.slot, :, :r].t()
            y.index_add_(0, g.rows, delta.to(y.dtype))
