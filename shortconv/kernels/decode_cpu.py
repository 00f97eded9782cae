"""The shared shape of the conv-like CPU decode fast paths (short conv, CCA conv).

One token per row: each row's window is u = [its state (K columns) ‖ x], the kernel's output
is some function of u, and the state becomes u's last K columns. With every row live on CPU
(`slots.all_live_cpu`) there is no pad row to mask, so the gather and the state write are a
plain index and index_copy_; any other batch runs the kernel's reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shortconv.kernels.outputs import decode_out


def shift_decode_cpu(
    x: torch.Tensor,
    states: torch.Tensor,
    cache_indices: torch.Tensor,
    pad_slot_id: int,
    out: torch.Tensor | None,
    window_out: Callable[[torch.Tensor], torch.Tensor],
    reference: Callable[[torch.Tensor], torch.Tensor],
    all_live: Callable[[torch.Tensor, int], bool],
) -> torch.Tensor:
    """x [B, C], states [n_slots, C, K] (shifted in place) -> out [B, C] = window_out(u) for
    u [B, C, K+1] fp32; `reference(out)` runs the batch instead unless `all_live` says every
    row is live. NOTE: `all_live` is passed by the caller so that its module's name for it is
    looked up per call (tests replace it there)."""
    out = decode_out(x, out)
    if x.shape[0] == 0:
        return out
    slots = cache_indices.to(device=x.device, dtype=torch.int64)
    if not all_live(slots, pad_slot_id):
        return reference(out)
    u = torch.cat([states[slots].to(torch.float32), x.to(torch.float32)[:, :, None]], dim=2)
    out.copy_(window_out(u))
    if states.shape[2] > 0:
        states.index_copy_(0, slots, u[:, :, 1:].to(states.dtype))
    return out
