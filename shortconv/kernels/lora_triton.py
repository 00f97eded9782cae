"""Triton batched LoRA: shrink and expand over segments of rows that share an adapter slot.

Same contract as `lora_ref` (Punica's SGMV: segmented gather matrix-vector products). The
rows are first laid out sorted by slot in BLOCK_M-aligned groups (`moe_align.align_routes`,
with the slot as the "expert": static shapes, no host sync, so a captured CUDA graph can replay
it for any mix of slots); then one program per (row block, output tile) runs one GEMM tile
against its block's one slot:
  * `_shrink_kernel`: s[rows] = x[rows] A[slot, :rank]^T, one program per block (the whole
    rank, <= 64, is one output tile), K looped over `in`;
  * `_expand_kernel`: y[rows, tile] += scale * s[rows] B[slot, tile, :rank]^T, in place.
Rows without an adapter (slot -1, or any slot outside [0, num_slots), such as the graph
buffer's zero slot) sort into no block, and blocks past the used ones return at once: those
rows cost no GEMM work and no weight reads, and their y is never touched.

As in `moe_triton`, the bodies are jitted lazily once per interpreter mode, use only core
builtins, and upcast bf16 operands to fp32 under the interpreter (`DOT_F32`: its `tl.dot`
multiplies bf16's raw bits); the compiled path keeps bf16/fp16 MMAs with fp32 accumulation.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shortconv.kernels.launch_config import GridKernel, LaunchConfig
from shortconv.kernels.lora_ref import check_lora_shapes
from shortconv.kernels.moe_align import MoeAlignment, align_routes, padded_length
from shortconv.kernels.moe_triton import block_m_for

# Ranks up to 64 fit one [BLOCK_M, BLOCK_R] fp32 accumulator; 16 is tl.dot's smallest width.
MAX_RANK = 64
MIN_BLOCK_R = 16
# block_n = the expand's output tile, block_i = the shrink's K step. 4 warps, 3 stages: both
# K loops are `for` loops the pipeliner double-buffers (registers/spills: docs/lora.md).
LORA_GEMM = LaunchConfig(64, 64, 4, 3)


def _shrink_kernel(
    x_ptr,
    a_ptr,
    s_ptr,
    row_ptr,
    slot_ptr,
    num_rows,
    in_features,
    x_st,
    x_sk,
    a_sl,
    a_sr,
    a_sk,
    s_st,
    s_sr,
    RANK: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = tl.load(slot_ptr + pid)
    if slot < 0:
        return  # past the used blocks: no rows, no weight reads
    m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(row_ptr + m)
    valid = row < num_rows  # the sentinel (num_rows) marks a group's padding
    row = tl.where(valid, row, 0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    rmask = r < RANK
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + row[:, None] * x_st + kk[None, :] * x_sk
    # A[slot] read transposed, as [BLOCK_K, BLOCK_R].
    a_ptrs = a_ptr + slot.to(tl.int64) * a_sl + r[None, :] * a_sr + kk[:, None] * a_sk
    acc = tl.full([BLOCK_M, BLOCK_R], 0.0, tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        kmask = kk + k0 < in_features
        xt = tl.load(x_ptrs + k0 * x_sk, mask=valid[:, None] & kmask[None, :], other=0.0)
        at = tl.load(a_ptrs + k0 * a_sk, mask=kmask[:, None] & rmask[None, :], other=0.0)
        if DOT_F32:  # interpreter + bf16 only; see the module docstring
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=PREC)
    s_ptrs = s_ptr + row[:, None] * s_st + r[None, :] * s_sr
    tl.store(s_ptrs, acc.to(s_ptr.dtype.element_ty), mask=valid[:, None] & rmask[None, :])


def _expand_kernel(
    s_ptr,
    b_ptr,
    y_ptr,
    row_ptr,
    slot_ptr,
    num_rows,
    out_features,
    scale,
    s_st,
    s_sr,
    b_sl,
    b_sn,
    b_sr,
    y_st,
    y_sn,
    RANK: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = tl.load(slot_ptr + pid)
    if slot < 0:
        return
    m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(row_ptr + m)
    valid = row < num_rows
    row = tl.where(valid, row, 0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    rmask = r < RANK
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < out_features
    st = tl.load(
        s_ptr + row[:, None] * s_st + r[None, :] * s_sr,
        mask=valid[:, None] & rmask[None, :],
        other=0.0,
    )
    # B[slot] read transposed, as [BLOCK_R, BLOCK_N].
    b_ptrs = b_ptr + slot.to(tl.int64) * b_sl + n[None, :] * b_sn + r[:, None] * b_sr
    bt = tl.load(b_ptrs, mask=rmask[:, None] & nmask[None, :], other=0.0)
    if DOT_F32:
        st = st.to(tl.float32)
        bt = bt.to(tl.float32)
    acc = tl.dot(st, bt, tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), input_precision=PREC)
    ymask = valid[:, None] & nmask[None, :]
    y_ptrs = y_ptr + row[:, None] * y_st + n[None, :] * y_sn
    # NOTE: every live row sits in exactly one block, so this read-add-write races with nobody.
    y = tl.load(y_ptrs, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc * scale).to(y_ptr.dtype.element_ty), mask=ymask)


@functools.cache
def _jitted(interpret: bool) -> tuple[GridKernel, GridKernel]:
    del interpret  # only the cache key: triton.jit reads the same knob
    return triton.jit(_shrink_kernel), triton.jit(_expand_kernel)


def _kernels() -> tuple[GridKernel, GridKernel]:
    return _jitted(bool(triton.knobs.runtime.interpret))


def align_rows(slots: torch.Tensor, num_slots: int) -> MoeAlignment:
    """The rows of `slots` int [T] sorted by slot into BLOCK_M-aligned groups (rows without an
    adapter in none). Shapes depend on (T, num_slots) only; share it between the two kernels."""
    ids = slots.reshape(-1, 1)
    return align_routes(ids, torch.ones_like(ids), num_slots, block_m_for(ids.shape[0], num_slots))


def _check_rank(rank: int) -> None:
    if not 0 < rank <= MAX_RANK:
        raise ValueError(f"the LoRA kernels take ranks 1..{MAX_RANK}, got {rank}")


def _check_align(align: MoeAlignment, num_rows: int, num_slots: int) -> None:
    """`align` is made by the caller (once per step): its shape must be that of `align_rows`
    over `num_rows` rows and `num_slots` slots (a host-side shape check, no sync)."""
    want = padded_length(num_rows, num_slots, align.block_m)
    if align.sorted_route_ids.numel() != want:
        raise ValueError(
            f"align was made for other rows: {align.sorted_route_ids.numel()} sorted rows, "
            f"align_rows of {num_rows} rows over {num_slots} slots has {want}"
        )


def _launch_options(
    rank: int, dtype: torch.dtype, align: MoeAlignment
) -> dict[str, str | bool | int | None]:
    """The constexprs and launch options both kernels share: the rank in a power-of-2 block
    (tl.dot's smallest width 16), the dot precision, and the row block of `align`."""
    dot_f32 = bool(triton.knobs.runtime.interpret) and dtype == torch.bfloat16
    return {
        "RANK": rank,
        "BLOCK_R": max(MIN_BLOCK_R, triton.next_power_of_2(rank)),
        # exact fp32 products for fp32 (not TF32); the interpreter cannot dot bf16 operands
        "PREC": "ieee" if dtype == torch.float32 or dot_f32 else None,
        "DOT_F32": dot_f32,
        "BLOCK_M": align.block_m,
        "num_warps": LORA_GEMM.num_warps,
        "num_stages": LORA_GEMM.num_stages,
    }


def lora_shrink_triton(
    x: torch.Tensor,
    a: torch.Tensor,
    slots: torch.Tensor,
    rank: int,
    *,
    align: MoeAlignment,
) -> torch.Tensor:
    """s [T, rank] = x A[slot]^T per row; see `lora_ref.lora_shrink_ref`.

    x [T, in] in A's dtype (fp32/bf16/fp16, any strides), a [num_slots, max_rank, in] (any
    strides: LoraSlots.a is a view), slots int [T] (outside [0, num_slots): no adapter, a zero
    row), rank <= 64 -> s [T, rank] in x's dtype, fp32 accumulation. `align`: `align_rows(slots,
    num_slots)`, made by the caller (the engine: once per step, for every layer)."""
    check_lora_shapes(x.shape[0], slots, a, rank, "A")
    _check_rank(rank)
    _check_align(align, x.shape[0], a.shape[0])
    if x.dtype != a.dtype or x.shape[1] != a.shape[2]:
        raise ValueError(f"x {x.dtype}{tuple(x.shape)} does not fit A {a.dtype}{tuple(a.shape)}")
    s = torch.zeros(x.shape[0], rank, dtype=x.dtype, device=x.device)
    shrink, _ = _kernels()
    shrink[(align.expert_of_block.numel(),)](
        x,
        a,
        s,
        align.sorted_route_ids,
        align.expert_of_block,
        x.shape[0],
        x.shape[1],
        x.stride(0),
        x.stride(1),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        s.stride(0),
        s.stride(1),
        BLOCK_K=LORA_GEMM.block_i,
        **_launch_options(rank, x.dtype, align),
    )
    return s


def lora_expand_triton(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    scale: float = 1.0,
    *,
    align: MoeAlignment,
) -> torch.Tensor:
    """y [T, out] += scale * s B[slot]^T in place, rows without an adapter untouched; see
    `lora_ref.lora_expand_ref`. s [T, rank] in B's dtype, b [num_slots, out, max_rank] (any
    strides: LoraSlots.b is a view), y any float dtype and strides -> y. `align` as the
    shrink's."""
    rank = s.shape[1]
    check_lora_shapes(y.shape[0], slots, b, rank, "B")
    _check_rank(rank)
    _check_align(align, y.shape[0], b.shape[0])
    if s.dtype != b.dtype or y.shape[1] != b.shape[1]:
        raise ValueError(f"y {tuple(y.shape)} / s {s.dtype} do not fit B {b.dtype}{tuple(b.shape)}")
    _, expand = _kernels()
    grid = (align.expert_of_block.numel(), triton.cdiv(y.shape[1], LORA_GEMM.block_n))
    expand[grid](
        s,
        b,
        y,
        align.sorted_route_ids,
        align.expert_of_block,
        y.shape[0],
        y.shape[1],
        scale,
        s.stride(0),
        s.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        y.stride(0),
        y.stride(1),
        BLOCK_N=LORA_GEMM.block_n,
        **_launch_options(rank, s.dtype, align),
    )
    return y


def lora_delta_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    rank: int,
    scale: float = 1.0,
    *,
    align: MoeAlignment,
) -> torch.Tensor:
    """y += scale * (x A[slot, :rank]^T) B[slot, :, :rank]^T per row, in place: the shrink and
    the expand over one alignment, `align_rows(slots, num_slots)`, which the caller makes once
    for every layer of a step (`LoraBatch`). x is cast to A's dtype first (a q8 base's float
    input)."""
    s = lora_shrink_triton(x.to(a.dtype), a, slots, rank, align=align)
    return lora_expand_triton(y, s, b, slots, scale, align=align)
