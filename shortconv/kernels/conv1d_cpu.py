"""The CPU fast path for the decode short conv (production code, not an oracle).

When every row of a decode step is a live request, the pad-row masking of the reference is
skipped (see `slots.all_live_cpu`); any other batch runs the reference. The oracle is
`conv1d_ref.causal_conv1d_update_ref`, and this path is tested against it.
"""

from __future__ import annotations

import torch

from shortconv.kernels.conv1d_ref import causal_conv1d_update_ref, tap_sum
from shortconv.kernels.decode_cpu import shift_decode_cpu
from shortconv.kernels.slots import all_live_cpu


def causal_conv1d_update_cpu(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state_indices: torch.Tensor,
    pad_slot_id: int = -1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_conv1d_update_ref`'s contract; all-live CPU batches skip the pad-row masking."""

    def window_out(u: torch.Tensor) -> torch.Tensor:
        acc = tap_sum(u, weight.to(torch.float32))
        return acc + bias.to(torch.float32)[None] if bias is not None else acc

    def reference(out: torch.Tensor) -> torch.Tensor:
        return causal_conv1d_update_ref(
            x, conv_state, weight, bias, conv_state_indices, pad_slot_id, out=out
        )

    return shift_decode_cpu(
        x, conv_state, conv_state_indices, pad_slot_id, out, window_out, reference, all_live_cpu
    )
