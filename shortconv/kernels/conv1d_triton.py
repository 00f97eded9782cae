"""Triton kernels for the depthwise causal short convolution (prefill and decode).

Same contract as `conv1d_ref`: pad rows (cache index == pad_slot_id) and tokens past
query_start_loc[-1] get zero outputs; pad rows leave every state slot untouched.

The kernel bodies are plain functions that are passed through `triton.jit` lazily, once per
interpreter mode: `triton.jit` decides between compiled and interpreted (TRITON_INTERPRET=1)
at decoration time, so decorating at import would freeze whatever the environment held when
this module was first imported. For the same reason the kernels use only core builtins
(tl.full, not tl.zeros / tl.sum): triton.language's own @jit helpers are fixed to one mode
when triton is first imported, and an interpreted kernel cannot call a compiled helper.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shortconv.kernels.launch_config import (
    CONV_PREFILL,
    CONV_SMALL,
    MAX_CONV_WIDTH,
    GridKernel,
)
from shortconv.kernels.outputs import decode_out, out_like


def _fn_out_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    state_ptr,
    qsl_ptr,
    seq_ptr,
    cache_ptr,
    init_ptr,
    out_ptr,
    dim,
    total,
    batch,
    pad_slot_id,
    x_sd,
    x_st,
    w_sd,
    w_sw,
    s_slot,
    s_d,
    s_w,
    o_sd,
    o_st,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # One [BLOCK_D, BLOCK_T] tile of the packed token axis; a tile may span several sequences,
    # so every token carries its own sequence's start, slot and initial-state flag.
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    dmask = d < dim
    tmask = t < total
    seq = tl.load(seq_ptr + t, mask=tmask, other=batch)
    valid = tmask & (seq < batch)
    seq = tl.where(valid, seq, 0)
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    slot = tl.load(cache_ptr + seq).to(tl.int64)
    live = valid & (slot != pad_slot_id)
    slot = tl.where(live, slot, 0)
    use_state = live & (tl.load(init_ptr + seq) != 0)
    t64 = t.to(tl.int64)
    pos = t64 - start  # position inside the token's own sequence
    d64 = d.to(tl.int64)

    acc = tl.full([BLOCK_D, BLOCK_T], 0.0, tl.float32)
    for j in tl.static_range(WIDTH):
        # Window tap j reads u[pos + j], u = [initial state (W-1 columns) ‖ sequence tokens].
        q = pos + j
        in_state = q < WIDTH - 1
        wj = tl.load(w_ptr + d64 * w_sd + j * w_sw, mask=dmask, other=0.0).to(tl.float32)
        xm = dmask[:, None] & (live & ~in_state)[None, :]
        x_off = d64[:, None] * x_sd + (t64 + j - (WIDTH - 1))[None, :] * x_st
        xv = tl.load(x_ptr + x_off, mask=xm, other=0.0).to(tl.float32)
        sm = dmask[:, None] & (use_state & in_state)[None, :]
        s_off = slot[None, :] * s_slot + d64[:, None] * s_d + q[None, :] * s_w
        sv = tl.load(state_ptr + s_off, mask=sm, other=0.0).to(tl.float32)
        acc += wj[:, None] * (xv + sv)  # the two masks are disjoint, so one term is zero
    if HAS_BIAS:
        bv = tl.load(b_ptr + d64, mask=dmask, other=0.0).to(tl.float32)
        acc += bv[:, None]
    acc = tl.where(live[None, :], acc, 0.0)
    o_off = d64[:, None] * o_sd + t64[None, :] * o_st
    tl.store(
        out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=dmask[:, None] & tmask[None, :]
    )


def _fn_state_kernel(
    x_ptr,
    state_ptr,
    qsl_ptr,
    cache_ptr,
    init_ptr,
    dim,
    pad_slot_id,
    x_sd,
    x_st,
    s_slot,
    s_d,
    s_w,
    WIDTH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Runs after _fn_out_kernel (same stream), so no output tile can still be reading the
    # initial state this overwrites.
    b = tl.program_id(1)
    d = (tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    dmask = d < dim
    k = tl.arange(0, BLOCK_K)
    kmask = k < WIDTH - 1
    slot = tl.load(cache_ptr + b).to(tl.int64)
    live = slot != pad_slot_id
    slot = tl.where(live, slot, 0)
    start = tl.load(qsl_ptr + b).to(tl.int64)
    length = tl.load(qsl_ptr + b + 1).to(tl.int64) - start
    has_init = tl.load(init_ptr + b) != 0
    # New column k is u[length + k]: old state while that is still inside it, else a token.
    q = length + k
    from_state = q < WIDTH - 1
    sm = dmask[:, None] & (kmask & from_state)[None, :] & live & has_init
    s_off = slot * s_slot + d[:, None] * s_d + q[None, :] * s_w
    sv = tl.load(state_ptr + s_off, mask=sm, other=0.0).to(tl.float32)
    xm = dmask[:, None] & (kmask & ~from_state)[None, :] & live
    x_off = d[:, None] * x_sd + (start + q - (WIDTH - 1))[None, :] * x_st
    xv = tl.load(x_ptr + x_off, mask=xm, other=0.0).to(tl.float32)
    new = sv + xv
    # Column k may be overwritten while another thread of this program still reads it as
    # column length + k; the barrier orders every load of the tile before any store.
    tl.debug_barrier()
    w_off = slot * s_slot + d[:, None] * s_d + k[None, :] * s_w
    wm = dmask[:, None] & kmask[None, :] & live
    tl.store(state_ptr + w_off, new.to(state_ptr.dtype.element_ty), mask=wm)


def _update_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    state_ptr,
    cache_ptr,
    out_ptr,
    dim,
    pad_slot_id,
    x_sb,
    x_sd,
    w_sd,
    w_sw,
    s_slot,
    s_d,
    s_w,
    o_sb,
    o_sd,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)
    d = (tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    dmask = d < dim
    k = tl.arange(0, BLOCK_K)
    kmask = k < WIDTH - 1
    slot = tl.load(cache_ptr + b).to(tl.int64)
    live = slot != pad_slot_id
    slot = tl.where(live, slot, 0)
    base = state_ptr + slot * s_slot + d[:, None] * s_d
    col = state_ptr + slot * s_slot + d * s_d
    xv = tl.load(x_ptr + b * x_sb + d * x_sd, mask=dmask & live, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + d * w_sd + (WIDTH - 1) * w_sw, mask=dmask, other=0.0)
    acc = xv * w_last.to(tl.float32)
    for j in tl.static_range(WIDTH - 1):
        wj = tl.load(w_ptr + d * w_sd + j * w_sw, mask=dmask, other=0.0).to(tl.float32)
        sj = tl.load(col + j * s_w, mask=dmask & live, other=0.0).to(tl.float32)
        acc += wj * sj
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    acc = tl.where(live, acc, 0.0)
    tl.store(out_ptr + b * o_sb + d * o_sd, acc.to(out_ptr.dtype.element_ty), mask=dmask)
    # Shift left by one column and append x.
    m2 = dmask[:, None] & kmask[None, :] & live
    nm = dmask[:, None] & (k + 1 < WIDTH - 1)[None, :] & live
    s_next = tl.load(base + (k + 1)[None, :] * s_w, mask=nm, other=0.0).to(tl.float32)
    new = tl.where((k == WIDTH - 2)[None, :], xv[:, None], s_next)
    tl.debug_barrier()  # every thread's reads of the old columns precede any overwrite
    tl.store(base + k[None, :] * s_w, new.to(state_ptr.dtype.element_ty), mask=m2)


@functools.cache
def _jitted(interpret: bool) -> tuple[GridKernel, GridKernel, GridKernel]:
    # `interpret` is only the cache key; triton.jit reads the same knob itself.
    del interpret
    return tuple(triton.jit(f) for f in (_fn_out_kernel, _fn_state_kernel, _update_kernel))


def _kernels() -> tuple[GridKernel, GridKernel, GridKernel]:
    return _jitted(bool(triton.knobs.runtime.interpret))


def _check_shapes(dim: int, weight: torch.Tensor, states: torch.Tensor) -> int:
    # Host-side shape checks only (no device reads): a mismatch here would be an OOB access.
    width = weight.shape[1]
    if not 2 <= width <= MAX_CONV_WIDTH:
        raise ValueError(f"short-conv width must be in 2..{MAX_CONV_WIDTH}, got {width}")
    if weight.shape[0] != dim or states.dim() != 3 or tuple(states.shape[1:]) != (dim, width - 1):
        raise ValueError(
            f"expected weight [{dim}, W] and conv state [n_slots, {dim}, W-1], "
            f"got {tuple(weight.shape)} and {tuple(states.shape)}"
        )
    return width


def token_sequence_ids(query_start_loc: torch.Tensor, total: int) -> torch.Tensor:
    """int32 [T]: each packed token's sequence, B for tokens past query_start_loc[-1].
    Computed on device: repeat_interleave would sync the host for its output size."""
    return torch.searchsorted(
        query_start_loc[1:].contiguous(),
        torch.arange(total, device=query_start_loc.device, dtype=query_start_loc.dtype),
        right=True,
    ).to(torch.int32)


def write_back_states(
    x: torch.Tensor,
    states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    pad_slot_id: int,
) -> None:
    """Each live sequence's slot <- the last K raw columns of [its state ‖ its tokens], for
    x [C, T] and states [n_slots, C, K] (K >= 1): the state update of a varlen conv of window
    K + 1 (the short conv's, and the CCA conv's). NOTE: launch it after the kernel that reads
    the initial states, on the same stream."""
    chans, k = states.shape[1:]
    block_d = min(CONV_PREFILL.block_i, triton.next_power_of_2(chans))
    _kernels()[1][(triton.cdiv(chans, block_d), cache_indices.numel())](
        x,
        states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        chans,
        pad_slot_id,
        x.stride(0),
        x.stride(1),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        WIDTH=k + 1,
        BLOCK_D=block_d,
        BLOCK_K=triton.next_power_of_2(k),
        num_warps=CONV_SMALL.num_warps,
        num_stages=CONV_SMALL.num_stages,
    )


def causal_conv1d_fn_triton(
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

    Shapes: x [dim, T] (any strides), weight [dim, W] with W in 2..MAX_CONV_WIDTH, bias [dim]
    or None, conv_states [n_slots, dim, W-1], query_start_loc int [B+1], cache_indices
    int32/int64 [B], has_initial_state bool [B]. Returns out [dim, T] in x's dtype (written
    into `out` when given), accumulated in fp32. Pad rows and tokens past query_start_loc[-1]
    produce zeros; pad rows touch no state. No host syncs.
    """
    dim, total = x.shape
    width = _check_shapes(dim, weight, conv_states)
    batch = cache_indices.numel()
    if out is None:
        out = out_like(x, dim, total)
    if batch == 0:
        return out.zero_()
    out_k = _kernels()[0]
    seq = token_sequence_ids(query_start_loc, total)
    block_d = min(CONV_PREFILL.block_i, triton.next_power_of_2(dim))
    block_t = CONV_PREFILL.block_n
    bias_arg = bias if bias is not None else weight
    grid = (triton.cdiv(dim, block_d), triton.cdiv(total, block_t))
    if total > 0:
        out_k[grid](
            x,
            weight,
            bias_arg,
            conv_states,
            query_start_loc,
            seq,
            cache_indices,
            has_initial_state,
            out,
            dim,
            total,
            batch,
            pad_slot_id,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            conv_states.stride(0),
            conv_states.stride(1),
            conv_states.stride(2),
            out.stride(0),
            out.stride(1),
            WIDTH=width,
            HAS_BIAS=bias is not None,
            BLOCK_D=block_d,
            BLOCK_T=block_t,
            num_warps=CONV_PREFILL.num_warps,
            num_stages=CONV_PREFILL.num_stages,
        )
    write_back_states(
        x, conv_states, query_start_loc, cache_indices, has_initial_state, pad_slot_id
    )
    return out


def causal_conv1d_update_triton(
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

    Shapes: x [B, dim] (any strides), conv_state [n_slots, dim, W-1], weight [dim, W] with
    W in 2..MAX_CONV_WIDTH, bias [dim] or None, conv_state_indices int32/int64 [B]. Returns out
    [B, dim] in x's dtype, accumulated in fp32. Pad rows produce zeros and touch no state. A single
    launch with no host syncs, so it is safe under CUDA graph capture.
    """
    batch, dim = x.shape
    width = _check_shapes(dim, weight, conv_state)
    out = decode_out(x, out)
    if batch == 0:
        return out
    _, _, update_k = _kernels()
    block_d = min(128, triton.next_power_of_2(dim))
    block_k = triton.next_power_of_2(width - 1)
    bias_arg = bias if bias is not None else weight
    update_k[(triton.cdiv(dim, block_d), batch)](
        x,
        weight,
        bias_arg,
        conv_state,
        conv_state_indices,
        out,
        dim,
        pad_slot_id,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        out.stride(0),
        out.stride(1),
        WIDTH=width,
        HAS_BIAS=bias is not None,
        BLOCK_D=block_d,
        BLOCK_K=block_k,
        num_warps=CONV_SMALL.num_warps,
        num_stages=CONV_SMALL.num_stages,
    )
    return out
