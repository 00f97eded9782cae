"""Triton kernels for ZAYA1's two-stage CCA conv over raw q‖k channels (prefill and decode).

Same contracts as `cca_ref`: token t of a sequence reads raw columns t..t+K of
u = [state (K columns, zeros when fresh) ‖ its tokens], K = (t0-1)+(t1-1); stage 1 is a
depthwise valid conv (kernel t0, bias b0) and stage 2 a grouped valid conv (kernel t1, bias b1,
groups of g channels = one head). Both stages run in one kernel: a program owns one head and a
block of columns (tokens, or decode rows), rebuilds the t1 stage-1 columns of each input-channel
chunk in registers and contracts them with the head's [g, g] stage-2 taps via tl.dot. Because a
fresh sequence's zero state columns still get b0 added, early stage-1 columns carry the bias
exactly like the reference's left padding.

Like `conv1d_triton`, kernel bodies are jitted lazily once per interpreter mode and use only
core builtins (tl.dot, tl.where, tl.full; no tl.sum), so TRITON_INTERPRET=1 works per test.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shortconv.kernels import conv1d_triton, launch_config
from shortconv.kernels.launch_config import CCA_DECODE, CCA_PREFILL, LaunchConfig
from shortconv.kernels.outputs import decode_out, out_like


def _cca_kernel(
    x_ptr,
    w0_ptr,
    b0_ptr,
    w1_ptr,
    b1_ptr,
    state_ptr,
    qsl_ptr,
    seq_ptr,
    cache_ptr,
    init_ptr,
    out_ptr,
    num_cols,
    batch,
    group,
    pad_slot_id,
    x_sc,
    x_sn,
    w0_sc,
    w0_sj,
    w1_sc,
    w1_si,
    w1_ss,
    s_slot,
    s_c,
    s_k,
    o_sc,
    o_sn,
    T0: tl.constexpr,
    T1: tl.constexpr,
    KW: tl.constexpr,
    HAS_B0: tl.constexpr,
    HAS_B1: tl.constexpr,
    DECODE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Column n is a packed token (extend) or a batch row (decode, which is extend with every
    # row a resumed one-token sequence: position 0, x column n).
    head = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < num_cols
    if DECODE:
        valid = nmask
        seq = tl.where(valid, n, 0)
    else:
        seq = tl.load(seq_ptr + n, mask=nmask, other=batch)
        valid = nmask & (seq < batch)  # tokens past query_start_loc[-1] belong to no sequence
        seq = tl.where(valid, seq, 0)
    slot = tl.load(cache_ptr + seq).to(tl.int64)
    live = valid & (slot != pad_slot_id)
    slot = tl.where(live, slot, 0)
    n64 = n.to(tl.int64)
    if DECODE:
        pos = n64 * 0
        use_state = live
    else:
        pos = n64 - tl.load(qsl_ptr + seq).to(tl.int64)
        use_state = live & (tl.load(init_ptr + seq) != 0)

    o = tl.arange(0, BLOCK_G)
    omask = o < group
    c_out = head * group + o
    acc = tl.full([BLOCK_G, BLOCK_N], 0.0, tl.float32)
    # NOTE: a loop (scf.for), not tl.static_range: unrolling all BLOCK_G/BLOCK_I chunks let
    # the compiler hoist every chunk's loads at once (8.9 KB of spills per thread at g=128).
    # Its bounds are constexprs, which the interpreter's `range` runs as well.
    for i0 in range(0, BLOCK_G, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        imask = i < group
        ci = head * group + i
        for s in tl.static_range(T1):
            # Stage-1 column s of every token: taps j read u[pos + s + j].
            st = tl.full([BLOCK_I, BLOCK_N], 0.0, tl.float32)
            for j in tl.static_range(T0):
                q = pos + (s + j)
                in_state = q < KW
                wj = tl.load(w0_ptr + ci * w0_sc + j * w0_sj, mask=imask, other=0.0)
                xm = imask[:, None] & (live & ~in_state)[None, :]
                x_off = ci[:, None] * x_sc + (n64 + (s + j - KW))[None, :] * x_sn
                xv = tl.load(x_ptr + x_off, mask=xm, other=0.0).to(tl.float32)
                sm = imask[:, None] & (use_state & in_state)[None, :]
                s_off = slot[None, :] * s_slot + ci[:, None] * s_c + q[None, :] * s_k
                sv = tl.load(state_ptr + s_off, mask=sm, other=0.0).to(tl.float32)
                acc_in = xv + sv  # disjoint masks: at most one term is nonzero
                st += wj.to(tl.float32)[:, None] * acc_in
            if HAS_B0:
                # Added to every stage-1 column, also those built from a fresh zero state.
                st += tl.load(b0_ptr + ci, mask=imask, other=0.0).to(tl.float32)[:, None]
            w1_off = c_out[:, None] * w1_sc + i[None, :] * w1_si + s * w1_ss
            w1m = omask[:, None] & imask[None, :]
            w1t = tl.load(w1_ptr + w1_off, mask=w1m, other=0.0)
            if LOW_PRECISION:
                # bf16/fp16: stage 1 rounded to the weights' dtype, then a tensor-core product
                # with fp32 accumulation (the model's own precision; see cca_conv_fn_triton).
                st = st.to(w1_ptr.dtype.element_ty)
                if UPCAST:  # the interpreter's dot cannot take bf16: same values, in fp32
                    st = st.to(tl.float32)
                    w1t = w1t.to(tl.float32)
                acc = tl.dot(w1t, st, acc, input_precision="ieee" if UPCAST else "tf32")
            else:
                # ieee: tf32 would cost ~1e-3 relative error against the fp32 reference.
                acc = tl.dot(w1t.to(tl.float32), st, acc, input_precision="ieee")
    if HAS_B1:
        acc += tl.load(b1_ptr + c_out, mask=omask, other=0.0).to(tl.float32)[:, None]
    acc = tl.where(live[None, :], acc, 0.0)
    o_off = c_out[:, None] * o_sc + n64[None, :] * o_sn
    omask2 = omask[:, None] & nmask[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=omask2)

    if DECODE and KW > 0:
        # Shift the slot left by one column and append x. NOTE: only this program reads these
        # (slot, channel) pairs (its head's channels of its rows), so ordering its own loads
        # before its stores is enough; rows share a slot only when padded, and pad rows skip.
        k = tl.arange(0, BLOCK_K)
        kmask = k < KW
        for i0 in range(0, BLOCK_G, BLOCK_I):
            ci = head * group + i0 + tl.arange(0, BLOCK_I)
            imask = ci < head * group + group
            m2 = imask[:, None] & live[None, :]
            xv = tl.load(x_ptr + ci[:, None] * x_sc + n64[None, :] * x_sn, mask=m2, other=0.0)
            base = slot[None, :, None] * s_slot + ci[:, None, None] * s_c
            nm = m2[:, :, None] & (k + 1 < KW)[None, None, :]
            nxt = tl.load(state_ptr + base + (k + 1)[None, None, :] * s_k, mask=nm, other=0.0)
            is_x = (k == KW - 1)[None, None, :]
            new = tl.where(is_x, xv.to(tl.float32)[:, :, None], nxt.to(tl.float32))
            tl.debug_barrier()  # every thread's reads (incl. the conv above) precede any store
            wm = m2[:, :, None] & kmask[None, None, :]
            dst = state_ptr + base + k[None, None, :] * s_k
            tl.store(dst, new.to(state_ptr.dtype.element_ty), mask=wm)


def shape_config(decode: bool, low_precision: bool) -> LaunchConfig:
    """Tiles and warps for this shape class (`launch_config` module: why these)."""
    return (CCA_DECODE if decode else CCA_PREFILL)[low_precision]


@functools.cache
def _jitted(interpret: bool, tune: bool) -> launch_config.GridKernel:
    # The arguments are only the cache key; triton.jit and launch_config read the same knobs.
    del interpret, tune
    return launch_config.jit(_cca_kernel, ("group", "DECODE", "BLOCK_N"), ("state_ptr",))


def _check_shapes(
    chans: int, w0: torch.Tensor, w1: torch.Tensor, states: torch.Tensor
) -> tuple[int, int, int]:
    """(t0, t1, g) after host-side shape checks (no device reads): a mismatch would be OOB."""
    if w0.dim() != 2 or w1.dim() != 3 or w0.shape[0] != chans or w1.shape[0] != chans:
        raise ValueError(
            f"expected w0 [{chans}, t0] and w1 [{chans}, g, t1], "
            f"got {tuple(w0.shape)} and {tuple(w1.shape)}"
        )
    t0, (g, t1) = w0.shape[1], w1.shape[1:]
    k = (t0 - 1) + (t1 - 1)
    if t0 < 1 or t1 < 1 or g < 1 or chans % g:
        raise ValueError(f"bad CCA conv kernels t0={t0}, t1={t1}, group {g} for {chans} channels")
    if states.dim() != 3 or tuple(states.shape[1:]) != (chans, k):
        raise ValueError(f"expected conv state [n_slots, {chans}, {k}], got {tuple(states.shape)}")
    return t0, t1, g


def _launch(
    x: torch.Tensor,
    x_sc: int,
    x_sn: int,
    w0: torch.Tensor,
    b0: torch.Tensor | None,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    states: torch.Tensor,
    qsl: torch.Tensor,
    seq: torch.Tensor,
    cache: torch.Tensor,
    init: torch.Tensor,
    pad_slot_id: int,
    out: torch.Tensor,
    o_sc: int,
    o_sn: int,
    num_cols: int,
    decode: bool,
) -> None:
    t0, t1, g = _check_shapes(w0.shape[0], w0, w1, states)
    kw = (t0 - 1) + (t1 - 1)
    block_g = max(16, triton.next_power_of_2(g))  # tl.dot wants every dimension >= 16
    low = w1.dtype in (torch.bfloat16, torch.float16)
    cfg = shape_config(decode, low)
    grid = (w0.shape[0] // g, triton.cdiv(num_cols, cfg.block_n))
    interpret = bool(triton.knobs.runtime.interpret)
    _jitted(interpret, launch_config.tuning())[grid](
        x,
        w0,
        b0 if b0 is not None else w0,
        w1,
        b1 if b1 is not None else w0,
        states,
        qsl,
        seq,
        cache,
        init,
        out,
        num_cols,
        cache.numel(),
        g,
        pad_slot_id,
        x_sc,
        x_sn,
        w0.stride(0),
        w0.stride(1),
        w1.stride(0),
        w1.stride(1),
        w1.stride(2),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        o_sc,
        o_sn,
        T0=t0,
        T1=t1,
        KW=kw,
        HAS_B0=b0 is not None,
        HAS_B1=b1 is not None,
        DECODE=decode,
        BLOCK_G=block_g,
        BLOCK_I=min(block_g, cfg.block_i),
        BLOCK_N=cfg.block_n,
        BLOCK_K=triton.next_power_of_2(max(kw, 1)),
        LOW_PRECISION=low,
        UPCAST=interpret,
        **launch_config.options(cfg, "_cca_kernel"),
    )


def cca_conv_fn_triton(
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

    Shapes: x [C, T] raw q‖k columns (any strides); w0 [C, t0], b0 [C] or None; w1 [C, g, t1],
    b1 [C] or None (C/g groups); conv_states [n_slots, C, K], K = (t0-1)+(t1-1);
    query_start_loc int [B+1]; cache_indices int32/int64 [B]; has_initial_state bool [B].
    Returns [C, T] in x's dtype (token-major when x is; written into `out` when given),
    accumulated in fp32. Afterwards each live slot holds the last K raw columns of its window.
    Pad rows and tokens past query_start_loc[-1] produce zeros; pad rows touch no state.
    No host syncs.
    """
    chans, total = x.shape
    batch = cache_indices.numel()
    if out is None:
        out = out_like(x, chans, total)
    if batch == 0 or total == 0:
        _check_shapes(chans, w0, w1, conv_states)
        return out.zero_()
    seq = conv1d_triton.token_sequence_ids(query_start_loc, total)
    _launch(
        x,
        x.stride(0),
        x.stride(1),
        w0,
        b0,
        w1,
        b1,
        conv_states,
        query_start_loc,
        seq,
        cache_indices,
        has_initial_state,
        pad_slot_id,
        out,
        out.stride(0),
        out.stride(1),
        total,
        decode=False,
    )
    if conv_states.shape[2] > 0:
        # A separate launch on the same stream: every token tile has read its sequence's
        # initial state before any slot is overwritten (new column j = u[len + j]).
        conv1d_triton.write_back_states(
            x, conv_states, query_start_loc, cache_indices, has_initial_state, pad_slot_id
        )
    return out


def cca_conv_update_triton(
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

    Shapes: x [B, C] (any strides); conv_states [n_slots, C, K]; w0/b0/w1/b1 as in
    `cca_conv_fn_triton`; cache_indices int32/int64 [B]. Returns [B, C] in x's dtype,
    accumulated in fp32. Pad rows produce zeros and touch no state. One launch, no host
    syncs: safe under CUDA graph capture.
    """
    batch, chans = x.shape
    out = decode_out(x, out)
    _check_shapes(chans, w0, w1, conv_states)
    if batch == 0:
        return out
    # Decode needs no query_start_loc / per-token sequence / has_initial_state: any int
    # tensor fills those pointer slots, and they are never read.
    _launch(
        x,
        x.stride(1),
        x.stride(0),
        w0,
        b0,
        w1,
        b1,
        conv_states,
        cache_indices,
        cache_indices,
        cache_indices,
        cache_indices,
        pad_slot_id,
        out,
        out.stride(1),
        out.stride(0),
        batch,
        decode=True,
    )
    return out
