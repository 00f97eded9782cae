"""Triton kernel bodies for paged attention (decode splits, their reduce, and extend).

The KV pool is flat `[N, Hk, d]` rows; position p of sequence b lives in row
`block_tables[b, p // PAGE] * PAGE + p % PAGE`, read in place (no gathered copy). A program owns
one KV head and every query head of its group (Hq / Hk), so each K/V block is loaded once per
group and multiplied against all of the group's queries with one `tl.dot`.

Softmax is the streaming (online) one in base 2: scores are pre-multiplied by
`scale * log2(e)`, so `exp2` replaces `exp`; running max `m` and denominator `l` are fp32.

Interpreter constraints (TRITON_INTERPRET=1 on CPU, flipped per test; see `conv1d_triton`):
* These bodies are jitted lazily by `attention_triton`, and they call no `@triton.jit` helper
  of triton.language (tl.max / tl.sum are such helpers, fixed to one mode at triton's import).
  Reductions go through the core `tl.reduce` with triton's own combine functions, which the
  interpreter recognises and runs with numpy.
* Loops with runtime bounds are `while` loops: the interpreter's `range` cannot take a loaded
  scalar (it holds a 1-element array), while a `while` condition can. Compiled, a `while` loop
  is an scf.while, and the bounds stay data-dependent, so short sequences do short loops.
* The interpreter's `tl.dot` mishandles bf16 (it stores bf16 as uint16), so `UPCAST` (set in
  interpreter mode) feeds the dots fp32 operands; compiled kernels dot in the input dtype.
"""

from __future__ import annotations

import triton.language as tl

# NOTE: triton.language.standard's combine functions; `tl.reduce` with these is what
# tl.max / tl.sum expand to, and the interpreter special-cases exactly these objects.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


def decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    qk_scale,
    group,
    head_dim,
    window,
    min_split_len,
    num_splits,
    num_heads,
    q_sb,
    q_sh,
    k_sn,
    k_sh,
    v_sn,
    v_sh,
    bt_sb,
    o_sb,
    o_sh,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    # One program: sequence b, KV head kvh, context split [split*split_len, +split_len) of
    # THIS row's context. Why per row: the grid's split count comes from the table width (a
    # static shape), and one wide bucket serves every context; splitting the table would put a
    # short row's whole context in split 0 (serial) and leave the others idle. split_len is the
    # row's share, at least min_split_len, in whole BLOCK_N blocks; splits past the row's end
    # run no loop and leave empty partials. With a window (> 0) the row's context is its last
    # `window` positions: the splits divide those, and no page before them is read (a sliding
    # layer's table may hold scratch page 0 there).
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < group
    dmask = d < head_dim
    heads = kvh * group + g
    qm = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=qm, other=0.0)
    q = q.to(tl.float32) if UPCAST else q.to(k_ptr.dtype.element_ty)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    first = tl.maximum(seq_len - tl.where(window > 0, window, seq_len), 0)
    split_len = tl.maximum((seq_len - first + num_splits - 1) // num_splits, min_split_len)
    split_len = (split_len + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    start = lo
    while start < hi:
        pos = start + tl.arange(0, BLOCK_N)
        live = pos < hi
        page = tl.load(bt_ptr + b * bt_sb + pos // PAGE, mask=live, other=0).to(tl.int64)
        row = page * PAGE + (pos % PAGE).to(tl.int64)
        km = dmask[:, None] & live[None, :]
        kt = tl.load(k_ptr + row[None, :] * k_sn + kvh * k_sh + d[:, None], mask=km, other=0.0)
        vm = live[:, None] & dmask[None, :]
        v = tl.load(v_ptr + row[:, None] * v_sn + kvh * v_sh + d[None, :], mask=vm, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _MAX))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
        start += BLOCK_N
    if DIRECT:  # one split: the split's result is the answer
        o = acc / den[:, None]
        dst = out_ptr + b * o_sb + heads[:, None] * o_sh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=qm)
    else:  # partials [B, Hq, S] (+ BLOCK_D for acc); an empty split leaves m=-inf, l=0
        part = (b * num_heads + heads) * num_splits + split
        tl.store(m_ptr + part, m, mask=gmask)
        tl.store(l_ptr + part, den, mask=gmask)
        tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=gmask[:, None])


def reduce_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    num_splits,
    num_heads,
    head_dim,
    o_sb,
    o_sh,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (sequence, query head): rescale each split to the global max and sum.
    # SPLITS (num_splits rounded up to a power of 2) covers every split's m and l at once, a
    # few registers each; the [splits, d] partial outputs go BLOCK_S splits at a time.
    # NOTE: a 256-split row loaded whole held 256 x d fp32 values per program (255 registers
    # and spills at d=128); the chunk bounds what one thread holds, whatever the split count.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    base = (b * num_heads + h) * num_splits
    s_all = tl.arange(0, SPLITS)
    all_mask = s_all < num_splits
    m_all = tl.load(m_ptr + base + s_all, mask=all_mask, other=float("-inf"))
    den = tl.load(l_ptr + base + s_all, mask=all_mask, other=0.0)
    # NOTE: split 0 always holds the row's first visible position (seq_lens >= 1), so the max
    # is finite and empty splits (m = -inf) get weight exp2(-inf) = 0.
    m_max = tl.reduce(m_all, 0, _MAX)
    total = tl.reduce(den * tl.exp2(m_all - m_max), 0, _SUM)
    num = tl.full([BLOCK_D], 0.0, tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):  # constexpr bounds: one pass when SPLITS <= BLOCK_S
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < num_splits
        m = tl.load(m_ptr + base + s, mask=smask, other=float("-inf"))
        part = base + s
        acc = tl.load(
            acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0
        )
        num += tl.reduce(acc * tl.exp2(m - m_max)[:, None], 0, _SUM)
    o = num / total
    dst = out_ptr + b * o_sb + h * o_sh + d
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    qsl_ptr,
    out_ptr,
    qk_scale,
    group,
    head_dim,
    window,
    q_st,
    q_sh,
    k_sn,
    k_sh,
    v_sn,
    v_sh,
    bt_sb,
    o_st,
    o_sh,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    # One program: sequence b, KV head kvh, query block mb (BLOCK_M tokens x the group's heads,
    # flattened to BLOCK_M * BLOCK_G rows: row r is token r // BLOCK_G, head r % BLOCK_G).
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    mb = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    n = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    ctx0 = seq_len - n  # position of the sequence's first new token
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    t = mb * BLOCK_M + r // BLOCK_G
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    rmask = (t < n) & (g < group)
    # NOTE: rows past the sequence's tokens attend as the block's first token (live whenever
    # the block runs its loop): never an empty softmax.
    first_q = ctx0 + mb * BLOCK_M  # position of the block's first token
    qpos = tl.where(t < n, ctx0 + t, first_q)
    # The first position each row sees: 0, or the start of its window.
    qlo = tl.where(window > 0, qpos - window + 1, 0)
    tok = (q_start + t).to(tl.int64)
    heads = kvh * group + g
    qm = rmask[:, None] & dmask[None, :]
    q = tl.load(
        q_ptr + tok[:, None] * q_st + heads[:, None] * q_sh + d[None, :], mask=qm, other=0.0
    )
    q = q.to(tl.float32) if UPCAST else q.to(k_ptr.dtype.element_ty)
    # Keys from the block's first query's window start (0 without a window) up to its last
    # query (causal); an empty block (mb past n) runs no loop.
    # NOTE: every row must see a key of the first BLOCK_N (else its first m stays -inf and
    # exp2(-inf - -inf) is NaN): the block's last row starts BLOCK_M - 1 after `lo`, so
    # BLOCK_M <= BLOCK_N (launch_config.ATTN_EXTEND: block_i <= block_n).
    hi = tl.where(mb * BLOCK_M < n, ctx0 + tl.minimum((mb + 1) * BLOCK_M, n), 0)
    lo = tl.where(window > 0, tl.maximum(first_q - window + 1, 0), 0)
    m = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    den = tl.full([BLOCK_M * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, tl.float32)
    start = lo
    while start < hi:
        pos = start + tl.arange(0, BLOCK_N)
        live = pos < hi
        page = tl.load(bt_ptr + b * bt_sb + pos // PAGE, mask=live, other=0).to(tl.int64)
        row = page * PAGE + (pos % PAGE).to(tl.int64)
        km = dmask[:, None] & live[None, :]
        kt = tl.load(k_ptr + row[None, :] * k_sn + kvh * k_sh + d[:, None], mask=km, other=0.0)
        vm = live[:, None] & dmask[None, :]
        v = tl.load(v_ptr + row[:, None] * v_sn + kvh * v_sh + d[None, :], mask=vm, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale
        seen = (pos[None, :] <= qpos[:, None]) & (pos[None, :] >= qlo[:, None])
        s = tl.where(live[None, :] & seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _MAX))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
        start += BLOCK_N
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    dst = out_ptr + tok[:, None] * o_st + heads[:, None] * o_sh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=qm)
