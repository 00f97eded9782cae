"""Pure-torch reference for the depthwise causal short convolution (prefill and decode).

Both entry points are vectorised over the batch and never read device values on the host, so
the decode path can be captured in a CUDA graph and the prefill path needs no per-request loop.

Pad rows (cache index == pad_slot_id) get zero outputs and leave every state slot untouched.
These are the oracles; the CPU decode fast path is `conv1d_cpu`.
"""

from __future__ import annotations

import torch

from shortconv.kernels.outputs import decode_out, out_like
from shortconv.kernels.slots import live_slots, scatter_states


def tap_sum(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_k u[..., k] * w[..., k] over the last (tap) dim, w broadcastable to u; fp32 in, fp32
    out. One multiply-add per tap: `(u * w).sum(-1)` over a 2-4 wide innermost dim took the
    slow small-reduction path (2x slower for the LFM2 conv, 6-8x for ZAYA1's CCA stage 1)."""
    acc = u[..., 0] * w[..., 0]
    for k in range(1, u.shape[-1]):
        acc.addcmul_(u[..., k], w[..., k])
    return acc


def causal_conv1d_fn_ref(
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
    """Varlen causal depthwise conv over packed sequences; updates conv_states in place.

    Shapes: x [dim, T] (any strides), weight [dim, W], bias [dim] or None,
    conv_states [n_slots, dim, W-1], query_start_loc int [B+1], cache_indices int [B],
    has_initial_state bool [B]. Returns out [dim, T] in x's dtype (written into `out` when
    given). Sequence b owns tokens query_start_loc[b]:query_start_loc[b+1]; its window runs
    over [initial state or zeros ‖ its tokens]. Pad rows, and tokens past
    query_start_loc[-1], produce zeros; pad rows touch no state.
    """
    dim, total = x.shape
    width = weight.shape[1]
    wm1 = width - 1
    batch = cache_indices.numel()
    dev = x.device
    if out is None:
        out = out_like(x, dim, total)
    if batch == 0:
        return out.zero_()
    qsl = query_start_loc.to(device=dev, dtype=torch.int64)
    slots, live, safe_slots = live_slots(cache_indices, pad_slot_id, dev)
    use_init = live & has_initial_state.to(device=dev, dtype=torch.bool)

    # Buffer columns: B blocks of W-1 initial-state columns, then the T packed tokens.
    init = conv_states[safe_slots].to(torch.float32)  # [B, dim, W-1]
    init = torch.where(use_init[:, None, None], init, torch.zeros_like(init))
    init_cols = init.permute(1, 0, 2).reshape(dim, batch * wm1)
    buf = torch.cat([init_cols, x.to(torch.float32)], dim=1)  # [dim, B*(W-1) + T]

    # searchsorted (not repeat_interleave) keeps the sequence lookup free of host syncs.
    tok = torch.arange(total, device=dev)
    seq_raw = torch.searchsorted(qsl[1:], tok, right=True)
    # Tokens past query_start_loc[-1] (graph padding) belong to no sequence: they output zeros.
    seq = seq_raw.clamp(max=batch - 1)
    pos = tok - qsl[seq]  # position inside its sequence
    q = pos[:, None] + torch.arange(width, device=dev)[None, :]  # index into u = [state ‖ x_b]
    from_state = q < wm1
    idx = torch.where(from_state, seq[:, None] * wm1 + q, batch * wm1 + qsl[seq][:, None] + q - wm1)
    win = buf[:, idx]  # [dim, T, W]
    acc = tap_sum(win, weight.to(torch.float32)[:, None, :])
    if bias is not None:
        acc = acc + bias.to(torch.float32)[:, None]
    tok_live = live[seq] & (seq_raw < batch)
    acc = torch.where(tok_live[None, :], acc, torch.zeros_like(acc))

    out.copy_(acc)

    if wm1 > 0:
        # New state = last W-1 columns of u_b; u_b is shorter than W-1 only through its state.
        lens = qsl[1:] - qsl[:-1]
        k = lens[:, None] + torch.arange(wm1, device=dev)[None, :]  # [B, W-1] index into u_b
        sidx = torch.where(
            k < wm1,
            torch.arange(batch, device=dev)[:, None] * wm1 + k,
            batch * wm1 + qsl[:-1, None] + k - wm1,
        )
        new_states = buf[:, sidx].permute(1, 0, 2)  # [B, dim, W-1]
        scatter_states(conv_states, slots, live, new_states)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state_indices: torch.Tensor,
    pad_slot_id: int = -1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row: conv over [state ‖ x], then shift x into the state in place.

    Shapes: x [B, dim], conv_state [n_slots, dim, W-1], weight [dim, W], bias [dim] or None,
    conv_state_indices int [B]. Returns out [B, dim] in x's dtype. Pad rows produce zeros and
    touch no state. No host syncs, so it is safe under CUDA graph capture.
    """
    out = decode_out(x, out)
    if x.shape[0] == 0:
        return out
    slots, live, safe_slots = live_slots(conv_state_indices, pad_slot_id, x.device)
    state = conv_state[safe_slots].to(torch.float32)  # [B, dim, W-1]
    u = torch.cat([state, x.to(torch.float32)[:, :, None]], dim=2)  # [B, dim, W]
    acc = tap_sum(u, weight.to(torch.float32))
    if bias is not None:
        acc = acc + bias.to(torch.float32)[None]
    acc = torch.where(live[:, None], acc, torch.zeros_like(acc))
    out.copy_(acc)
    if conv_state.shape[2] > 0:
        scatter_states(conv_state, slots, live, u[:, :, 1:])
    return out
