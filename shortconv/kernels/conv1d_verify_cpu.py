"""The CPU fast path of the varlen short conv for equal-length resumed rows: verify steps.

A speculative verify step at batch 1 (or any step whose rows all resume state with the same
number of tokens) is a chunked-prefill step to the reference, which spends about two dozen
small ops a layer on the general packing (a sequence lookup by searchsorted, a window index
per token, pad-row masking). With every row live, resumed and Q tokens long, the windows are
one `unfold` of [state ‖ tokens] per row: a handful of ops. Any other batch runs the
reference (`conv1d_ref.causal_conv1d_fn_ref`, the oracle this path is tested against).
"""

from __future__ import annotations

import torch

from shortconv.kernels.conv1d_ref import causal_conv1d_fn_ref, tap_sum
from shortconv.kernels.slots import all_live_cpu


def causal_conv1d_fn_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    pad_slot_id: int = -1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_conv1d_fn_ref`'s contract (x [dim, T], conv_states [n_slots, dim, W-1], ...);
    equal-length resumed live rows on CPU take the unfold path."""
    width = _uniform_width(x, query_start_loc, cache_indices, has_initial_state, pad_slot_id)
    if width == 0 or weight.shape[1] < 2:
        return causal_conv1d_fn_ref(
            x,
            weight,
            bias,
            conv_states,
            query_start_loc,
            cache_indices,
            has_initial_state,
            pad_slot_id,
            out=out,
        )
    slots = cache_indices.to(torch.int64)
    result, u = _unfold_conv(x, weight, bias, conv_states, slots, width)
    wm1 = weight.shape[1] - 1
    # NOTE: live rows of one step never share a slot, so index_copy_ is deterministic.
    conv_states.index_copy_(0, slots, u[:, :, -wm1:].to(conv_states.dtype))
    return result.to(x.dtype) if out is None else out.copy_(result)


def verify_conv1d_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    cache_indices: torch.Tensor,
    width: int,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """A verify step's conv and all its state writes, for rows the step resolved once
    (`execution.step_tensors.VerifyRows`): every row live and resumed with `width` tokens.

    x [dim, B*width], conv_states [n_slots, dim, W-1], cache_indices int64 [B], state_slots
    int64 [B*width] (per row: the slots of the states after its positions 1..width, its
    spec slots then its live slot). Same output and states, bit for bit, as
    `state_checkpoint.save_state_checkpoints` of those checkpoints followed by
    `causal_conv1d_fn_cpu`, in one scatter instead of a dozen small ops a layer.
    """
    wm1 = weight.shape[1] - 1
    if wm1 < 1:
        raise ValueError("a verify conv needs a kernel of width >= 2 (a state to keep)")
    result, u = _unfold_conv(x, weight, bias, conv_states, cache_indices, width)
    # The state after position j of a row is columns j..j+W-2 of u: the row's windows 1..Q.
    states = u[:, :, 1:].unfold(2, wm1, 1).permute(0, 2, 1, 3).reshape(-1, x.shape[0], wm1)
    # NOTE: the step's slots are distinct (spec slots belong to one row), so deterministic.
    conv_states.index_copy_(0, state_slots, states.to(conv_states.dtype))
    return result.to(x.dtype)


def _unfold_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the conv of every row in fp32 [dim, T], u = [state ‖ tokens] [B, dim, W-1+Q])."""
    dim, total = x.shape
    wm1, batch = weight.shape[1] - 1, slots.numel()
    rows = x.to(torch.float32).view(dim, batch, width).permute(1, 0, 2)  # [B, dim, Q]
    u = torch.cat([conv_states[slots].to(torch.float32), rows], dim=2)  # [B, dim, W-1+Q]
    acc = tap_sum(u.unfold(2, wm1 + 1, 1), weight.to(torch.float32)[None, :, None, :])
    if bias is not None:
        acc = acc + bias.to(torch.float32)[None, :, None]
    return acc.permute(1, 0, 2).reshape(dim, total), u


def _uniform_width(
    x: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    pad_slot_id: int,
) -> int:
    """Q when every row is live, resumes its state and has exactly Q = T / B tokens (no graph
    padding past the last row); 0 otherwise. Host reads are free on CPU (nothing captured)."""
    batch, total = cache_indices.numel(), x.shape[1]
    if x.device.type != "cpu" or batch == 0 or total % batch:
        return 0
    width = total // batch
    lens = query_start_loc.to(torch.int64).diff()
    if int(query_start_loc[-1]) != total or not bool((lens == width).all()):
        return 0
    if not bool(has_initial_state.to(torch.bool).all()):
        return 0
    return width if all_live_cpu(cache_indices, pad_slot_id) else 0
