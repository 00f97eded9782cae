"""The CPU fast path for the decode short conv (production code, not an oracle).

When every row of a decode step is a live request, the pad-row masking of the reference is
skipped (see `slots.all_live_cpu`); any other batch runs the reference. The oracle is
`conv1d_ref.causal_conv1d_update_ref`, and this path is tested against it.
"""

from __future__ import annotations

import torch

from shortconv.kernels.conv1d_ref import causal_conv1d_update_ref, tap_sum
from shortconv.kernels.outputs import decode_out
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
    out = decode_out(x, out)
    if x.shape[0] == 0:
        return out
    slots = conv_state_indices.to(device=x.device, dtype=torch.int64)
    if not all_live_cpu(slots, pad_slot_id):
        return causal_conv1d_update_ref(
            x, conv_state, weight, bias, conv_state_indices, pad_slot_id, out=out
        )
    u = torch.cat([conv_state[slots].to(torch.float32), x.to(torch.float32)[:, :, None]], 2)
    acc = tap_sum(u, weight.to(torch.float32))
    out.copy_(acc + bias.to(torch.float32)[None] if bias is not None else acc)
    if conv_state.shape[2] > 0:
        conv_state.index_copy_(0, slots, u[:, :, 1:].to(conv_state.dtype))
    return out
