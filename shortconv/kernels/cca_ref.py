"""Pure-torch reference kernels for ZAYA1's CCA: the two-stage q‖k conv and the previous-token
value. Triton twins must keep these contracts (shapes, in-place state updates, pad rows).

The CCA conv over one sequence reads raw columns u = [state (K columns) ‖ its tokens], where
K = (t0-1) + (t1-1): stage 1 is a depthwise *valid* conv (kernel t0, with bias), stage 2 a
grouped *valid* conv (kernel t1, with bias, one group per head). Token t therefore sees raw
columns t..t+K of u. A fresh sequence's state is K zero columns, so the stage-1 columns built
from them equal the stage-1 bias: this is the reference's left padding of the raw input, which
two zero-padded causal convs would not reproduce.

Rows whose cache index equals `pad_slot_id` produce zeros and read and write no state slot.
Every entry point is vectorised over the batch with no host syncs (decode is graph-safe).
These are the oracles; the CPU decode fast paths are in `cca_cpu`.
"""

from __future__ import annotations

import torch

from shortconv.kernels.outputs import decode_out
from shortconv.kernels.slots import live_slots, scatter_states


def _two_stage(
    win: torch.Tensor,
    w0: torch.Tensor,
    b0: torch.Tensor | None,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
) -> torch.Tensor:
    """win [C, N, K+1] raw windows (fp32) → [C, N]: depthwise (w0 [C, t0]) then grouped
    (w1 [C, g, t1], groups of g channels) valid convs, each with its bias."""
    chans, n, _ = win.shape
    t0, (g, t1) = w0.shape[1], w1.shape[1:]
    # Stage 1 tap by tap (see conv1d_ref.tap_sum for why not unfold + sum(-1)).
    w0f = w0.float()[:, None, :]
    stage1 = win[:, :, :t1] * w0f[:, :, 0:1]  # [C, N, t1]
    for k in range(1, t0):
        stage1.addcmul_(win[:, :, k : k + t1], w0f[:, :, k : k + 1])
    if b0 is not None:
        stage1 = stage1 + b0.float()[:, None, None]
    groups = chans // g
    w = w1.float().view(groups, g, g, t1)  # [G, out, in, t1]
    out = torch.einsum("goit,gint->gon", w, stage1.view(groups, g, n, t1)).reshape(chans, n)
    if b1 is not None:
        out = out + b1.float()[:, None]
    return out


def cca_conv_fn_ref(
    x: torch.Tensor,
    w0: torch.Tensor,
    b0: torch.Tensor | None,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    pad_slot_id: int = -1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen two-stage CCA conv over packed sequences; updates conv_states in place.

    Shapes: x [C, T] raw q‖k columns (any strides); w0 [C, t0], b0 [C] or None (depthwise);
    w1 [C, g, t1], b1 [C] or None (grouped, C/g groups); conv_states [n_slots, C, K] with
    K = (t0-1)+(t1-1); query_start_loc int [B+1]; cache_indices int [B]; has_initial_state
    bool [B]. Returns [C, T] in x's dtype (written into `out` when given). Sequence b's window
    runs over [its state if has_initial_state else K zeros ‖ its tokens]; afterwards its slot
    holds the last K raw columns of that window. Pad rows and tokens past query_start_loc[-1]
    produce zeros; pad rows touch no state.
    """
    chans, total = x.shape
    k = conv_states.shape[2]
    batch = cache_indices.numel()
    dev = x.device
    if out is None:
        out = torch.empty(chans, total, dtype=x.dtype, device=dev)
    if batch == 0 or total == 0:
        return out.zero_()
    qsl = query_start_loc.to(device=dev, dtype=torch.int64)
    slots, live, safe = live_slots(cache_indices, pad_slot_id, dev)
    use_init = live & has_initial_state.to(device=dev, dtype=torch.bool)

    # Buffer columns: B blocks of K initial-state columns, then the T packed tokens.
    init = conv_states[safe].float()  # [B, C, K]
    init = torch.where(use_init[:, None, None], init, torch.zeros_like(init))
    buf = torch.cat([init.permute(1, 0, 2).reshape(chans, batch * k), x.float()], dim=1)

    tok = torch.arange(total, device=dev)
    seq_raw = torch.searchsorted(qsl[1:], tok, right=True)
    seq = seq_raw.clamp(max=batch - 1)
    starts = qsl[seq]
    q = (tok - starts)[:, None] + torch.arange(k + 1, device=dev)[None, :]  # index into u_b
    idx = torch.where(q < k, seq[:, None] * k + q, batch * k + starts[:, None] + q - k)
    acc = _two_stage(buf[:, idx], w0, b0, w1, b1)
    tok_live = live[seq] & (seq_raw < batch)
    out.copy_(torch.where(tok_live[None, :], acc, torch.zeros_like(acc)))

    if k > 0:
        # New state = last K columns of u_b (reaching into the old state for short chunks).
        lens = qsl[1:] - qsl[:-1]
        j = lens[:, None] + torch.arange(k, device=dev)[None, :]
        sidx = torch.where(
            j < k,
            torch.arange(batch, device=dev)[:, None] * k + j,
            batch * k + qsl[:-1, None] + j - k,
        )
        scatter_states(conv_states, slots, live, buf[:, sidx].permute(1, 0, 2))
    return out


def cca_conv_update_ref(
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
    """One decode token per row: two-stage conv over [state ‖ x], then shift x into the state.

    Shapes: x [B, C]; conv_states [n_slots, C, K]; w0/b0/w1/b1 as in `cca_conv_fn_ref`;
    cache_indices int [B]. Returns [B, C] in x's dtype. Pad rows produce zeros and touch no
    state. No host syncs, so it is safe under CUDA graph capture.
    """
    out = decode_out(x, out)
    if x.shape[0] == 0:
        return out
    slots, live, safe = live_slots(cache_indices, pad_slot_id, x.device)
    u = torch.cat([conv_states[safe].float(), x.float()[:, :, None]], dim=2)  # [B, C, K+1]
    acc = _two_stage(u.permute(1, 0, 2), w0, b0, w1, b1).t()
    out.copy_(torch.where(live[:, None], acc, torch.zeros_like(acc)))
    if conv_states.shape[2] > 0:
        scatter_states(conv_states, slots, live, u[:, :, 1:])
    return out


def cca_prev_value_fn_ref(
    v: torch.Tensor,
    prev_state: torch.Tensor,
    init_value: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Shift each packed sequence's delayed values one token back; updates prev_state in place.

    Shapes: v [T, D] (the delayed projection of every new token); prev_state [n_slots, D];
    init_value [D] or None (zeros): what a fresh sequence's first token sees, i.e. the delayed
    projection of a zero hidden state; query_start_loc int [B+1]; cache_indices int [B];
    has_initial_state bool [B]. Returns [T, D]: row t is v[t-1] inside a sequence, and the
    slot's value (resumed) or init_value (fresh) for a sequence's first token. Each live slot
    then holds its sequence's last row of v. Pad rows produce zeros and touch no state.
    """
    total, dim = v.shape
    batch = cache_indices.numel()
    dev = v.device
    if batch == 0 or total == 0:
        return torch.zeros_like(v)
    qsl = query_start_loc.to(device=dev, dtype=torch.int64)
    slots, live, safe = live_slots(cache_indices, pad_slot_id, dev)
    fresh = init_value if init_value is not None else v.new_zeros(dim)
    resumed = has_initial_state.to(device=dev, dtype=torch.bool)[:, None]
    first_val = torch.where(resumed, prev_state[safe].to(v.dtype), fresh.to(v.dtype)[None, :])

    tok = torch.arange(total, device=dev)
    seq_raw = torch.searchsorted(qsl[1:], tok, right=True)
    seq = seq_raw.clamp(max=batch - 1)
    shifted = torch.cat([v.new_zeros(1, dim), v[:-1]], dim=0)
    res = torch.where((tok == qsl[seq])[:, None], first_val[seq], shifted)
    tok_live = live[seq] & (seq_raw < batch)
    res = torch.where(tok_live[:, None], res, torch.zeros_like(res))

    lens = qsl[1:] - qsl[:-1]
    last = v[(qsl[1:] - 1).clamp(min=0)]
    # An empty sequence keeps whatever its slot held.
    new = torch.where((lens > 0)[:, None], last.to(prev_state.dtype), prev_state[safe])
    scatter_states(prev_state, slots, live, new)
    return res


def cca_prev_value_update_ref(
    v: torch.Tensor,
    prev_state: torch.Tensor,
    cache_indices: torch.Tensor,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Decode twin of `cca_prev_value_fn_ref` (every row resumes): returns prev_state[slot]
    [B, D] and stores v [B, D] in the slot. Pad rows produce zeros and touch no state."""
    if v.shape[0] == 0:
        return torch.zeros_like(v)
    slots, live, safe = live_slots(cache_indices, pad_slot_id, v.device)
    res = torch.where(live[:, None], prev_state[safe].to(v.dtype), torch.zeros_like(v))
    scatter_states(prev_state, slots, live, v)
    return res
