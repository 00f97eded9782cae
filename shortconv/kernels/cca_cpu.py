"""The CPU fast paths for ZAYA1's CCA decode kernels (production code, not oracles).

When every row of a decode step is a live request, the pad-row masking of the reference is
skipped (see `slots.all_live_cpu`); any other batch runs the reference. The oracles are
`cca_ref.cca_conv_update_ref` and `cca_ref.cca_prev_value_update_ref`, and these paths are
tested against them.
"""

from __future__ import annotations

import torch

from shortconv.kernels.cca_ref import _two_stage, cca_conv_update_ref, cca_prev_value_update_ref
from shortconv.kernels.decode_cpu import shift_decode_cpu
from shortconv.kernels.slots import all_live_cpu


def cca_conv_update_cpu(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    w0: torch.Tensor,
    b0: torch.Tensor | None,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    cache_indices: torch.Tensor,
    pad_slot_id: int = -1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`cca_conv_update_ref`'s contract; all-live CPU batches skip the pad-row masking."""

    def window_out(u: torch.Tensor) -> torch.Tensor:
        return _two_stage(u.permute(1, 0, 2), w0, b0, w1, b1).t()

    def reference(out: torch.Tensor) -> torch.Tensor:
        return cca_conv_update_ref(
            x, conv_states, w0, b0, w1, b1, cache_indices, pad_slot_id, out=out
        )

    return shift_decode_cpu(
        x, conv_states, cache_indices, pad_slot_id, out, window_out, reference, all_live_cpu
    )


def cca_prev_value_update_cpu(
    v: torch.Tensor,
    prev_state: torch.Tensor,
    cache_indices: torch.Tensor,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """`cca_prev_value_update_ref`'s contract; all-live CPU batches skip the pad-row masking."""
    if v.shape[0] == 0:
        return torch.zeros_like(v)
    slots = cache_indices.to(device=v.device, dtype=torch.int64)
    if not all_live_cpu(slots, pad_slot_id):
        return cca_prev_value_update_ref(v, prev_state, cache_indices, pad_slot_id)
    res = prev_state[slots].to(v.dtype)
    prev_state.index_copy_(0, slots, v.to(prev_state.dtype))
    return res
