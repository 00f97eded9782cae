"""Pure-PyTorch oracle for the batched LoRA kernels (shrink / expand, as in Punica's SGMV).

Each token row t uses the adapter in slot `slots[t]`; a slot outside [0, num_slots) (-1: no
adapter, or the graph buffer's zero slot `num_slots`) means none, and that row is left alone:

    shrink:  s[t] = x[t] A[slots[t], :rank]^T           x [T, in], A [num_slots, max_rank, in]
    expand:  y[t] += scale * s[t] B[slots[t], :, :rank]^T   B [num_slots, out, max_rank]

Products accumulate in fp32; the shrink's result is rounded to x's dtype (the expand's
input, as the kernel keeps it) and the expand rounds once, when it adds into y.
"""

from __future__ import annotations

import torch


def live_rows(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """bool [T]: the rows whose slot names an adapter."""
    return (slots >= 0) & (slots < num_slots)


def check_lora_shapes(
    rows: int, slots: torch.Tensor, weights: torch.Tensor, rank: int, name: str
) -> None:
    """`slots` int [rows]; `weights` (A or B) 3-D, slot-major, holding at least `rank` ranks."""
    if slots.dim() != 1 or slots.shape[0] != rows or slots.is_floating_point():
        raise ValueError(f"slots must be an int tensor [{rows}], got {tuple(slots.shape)}")
    if weights.dim() != 3:
        raise ValueError(f"{name} must be [num_slots, ...] 3-D, got {tuple(weights.shape)}")
    max_rank = weights.shape[1] if name == "A" else weights.shape[2]
    if not 0 < rank <= max_rank:
        raise ValueError(f"rank must be in 1..{max_rank} ({name}'s ranks), got {rank}")


def lora_shrink_ref(
    x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, rank: int
) -> torch.Tensor:
    """x [T, in], a [num_slots, max_rank, in], slots int [T] -> s [T, rank] in x's dtype
    (zeros in rows without an adapter)."""
    check_lora_shapes(x.shape[0], slots, a, rank, "A")
    live = live_rows(slots, a.shape[0])
    per_row = a[slots.clamp(0, a.shape[0] - 1).long(), :rank].float()  # [T, rank, in]
    s = torch.einsum("ti,tri->tr", x.float(), per_row)
    return torch.where(live[:, None], s, 0.0).to(x.dtype)


def lora_expand_ref(
    y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """y [T, out] += scale * s B[slot]^T in place, for rows with an adapter; s [T, rank],
    b [num_slots, out, max_rank], slots int [T] -> y."""
    rank = s.shape[1]
    check_lora_shapes(y.shape[0], slots, b, rank, "B")
    live = live_rows(slots, b.shape[0])
    per_row = b[slots.clamp(0, b.shape[0] - 1).long(), :, :rank].float()  # [T, out, rank]
    delta = torch.einsum("tr,tor->to", s.float(), per_row) * scale
    summed = (y.float() + delta).to(y.dtype)
    y.copy_(torch.where(live[:, None], summed, y))
    return y
