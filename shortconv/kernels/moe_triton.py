"""Triton fused MoE: grouped GEMMs over the chosen experts only, static shapes, no host sync.

Same contract as `moe_ref.fused_moe_ref`. Three steps, all fixed-size for given (T, k, E), so
a captured CUDA graph can replay them for any routing:
  1. `moe_align.align_routes` sorts the T*k routes by expert into BLOCK_M-aligned groups;
  2. `_gate_up_kernel`: per block of one expert, h = act(x W_gate^T) * (x W_up^T), written
     per padded slot into [padded_len, I];
  3. `_down_kernel`: y = weight * (h W_down^T), written per route into [T*k, H] (skip routes
     stay zero), then a fixed-order sum over k (no atomics, so the result is deterministic).
Blocks past the used ones (expert -1) return at once, so skip routes and unused experts cost no
GEMM work and no weight reads.

As in `conv1d_triton`, the kernel bodies are jitted lazily once per interpreter mode and use
only core builtins (triton.language's own @jit helpers are fixed to one mode at import).

bf16 under TRITON_INTERPRET=1: the interpreter keeps bf16 tensors as their raw uint16 bits and
its `tl.dot` is a plain numpy matmul of those bits (Triton 3.6 converts only fp8 operands), so a
bf16 dot returns garbage (~1e10). There the kernels upcast both operands to fp32 first
(`DOT_F32`) and use ieee products: bf16 x bf16 products are exact in fp32, so this is the same
math as the GPU's bf16 MMA with fp32 accumulation, which the compiled path keeps.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shortconv.kernels import launch_config
from shortconv.kernels.launch_config import MOE_GEMM
from shortconv.kernels.moe_align import MoeAlignment, align_routes
from shortconv.kernels.moe_ref import check_moe_shapes

_ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
BLOCK_N = 64
BLOCK_K = 64


def _gate_up_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    d_ptr,
    route_ptr,
    expert_ptr,
    num_routes,
    top_k,
    x_st,
    x_sh,
    w_se,
    w_sn,
    w_sk,
    h_sm,
    h_sn,
    d_sr,
    d_sn,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    ACT: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return  # padding past the used blocks: no routes, no weight reads
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(route_ptr + m)
    valid = route < num_routes  # the sentinel (num_routes) marks a group's padding
    tok = tl.where(valid, route // top_k, 0).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < INTER
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * x_st + kk[None, :] * x_sh
    # gate rows are [0, I) of the expert's gate_up, up rows [I, 2I); read as [BLOCK_K, BLOCK_N].
    g_ptrs = w_ptr + e.to(tl.int64) * w_se + n[None, :] * w_sn + kk[:, None] * w_sk
    u_ptrs = g_ptrs + INTER * w_sn
    acc_g = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    acc_u = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        kmask = kk + k0 < HIDDEN
        a = tl.load(a_ptrs + k0 * x_sh, mask=valid[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        g = tl.load(g_ptrs + k0 * w_sk, mask=wmask, other=0.0)
        u = tl.load(u_ptrs + k0 * w_sk, mask=wmask, other=0.0)
        if DOT_F32:  # interpreter + bf16 only; see the module docstring
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PREC)
        acc_u = tl.dot(a, u, acc_u, input_precision=PREC)
    if HAS_DELTA:  # a per-route addend of gate ‖ up [T*k, 2I] (expert LoRA), before act
        r64 = tl.where(valid, route, 0).to(tl.int64)
        d_ptrs = d_ptr + r64[:, None] * d_sr + n[None, :] * d_sn
        dmask = valid[:, None] & nmask[None, :]
        acc_g += tl.load(d_ptrs, mask=dmask, other=0.0).to(tl.float32)
        acc_u += tl.load(d_ptrs + INTER * d_sn, mask=dmask, other=0.0).to(tl.float32)
    if ACT == 0:  # silu
        act = acc_g / (1.0 + tl.exp(-acc_g))
    elif ACT == 1:  # gelu (erf)
        act = 0.5 * acc_g * (1.0 + tl.math.erf(acc_g * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1)
        z = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
        act = 0.5 * acc_g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    else:  # relu
        act = tl.where(acc_g > 0.0, acc_g, 0.0)
    h = act * acc_u
    h_ptrs = h_ptr + m[:, None].to(tl.int64) * h_sm + n[None, :] * h_sn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


def _down_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    d_ptr,
    route_ptr,
    expert_ptr,
    rw_ptr,
    num_routes,
    h_sm,
    h_sk,
    w_se,
    w_sn,
    w_sk,
    y_sr,
    y_sn,
    d_sr,
    d_sn,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(route_ptr + m)
    valid = route < num_routes
    route = tl.where(valid, route, 0).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < HIDDEN
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + m[:, None].to(tl.int64) * h_sm + kk[None, :] * h_sk
    b_ptrs = w_ptr + e.to(tl.int64) * w_se + n[None, :] * w_sn + kk[:, None] * w_sk
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kmask = kk + k0 < INTER
        # NOTE: padding rows of h were never written (uninitialised): the mask keeps them out.
        a = tl.load(a_ptrs + k0 * h_sk, mask=valid[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs + k0 * w_sk, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    if HAS_DELTA:  # a per-route addend of the expert's output [T*k, H], before the weight
        d_ptrs = d_ptr + route[:, None] * d_sr + n[None, :] * d_sn
        acc += tl.load(d_ptrs, mask=valid[:, None] & nmask[None, :], other=0.0).to(tl.float32)
    rw = tl.load(rw_ptr + route, mask=valid, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    y_ptrs = y_ptr + route[:, None] * y_sr + n[None, :] * y_sn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@functools.cache
def _jitted(
    interpret: bool, tune: bool
) -> tuple[launch_config.GridKernel, launch_config.GridKernel]:
    # The arguments are only the cache key; triton.jit and launch_config read the same knobs.
    del interpret, tune
    key = ("HIDDEN", "INTER", "BLOCK_M")
    return launch_config.jit(_gate_up_kernel, key), launch_config.jit(_down_kernel, key)


def _kernels() -> tuple[launch_config.GridKernel, launch_config.GridKernel]:
    return _jitted(bool(triton.knobs.runtime.interpret), launch_config.tuning())


def block_m_for(num_routes: int, num_experts: int) -> int:
    """Rows per GEMM block from the mean group size: decode batches put a few rows on each
    expert (a 64-row block would be mostly padding), prefill chunks fill larger blocks."""
    mean_rows = num_routes / max(num_experts, 1)
    return 16 if mean_rows <= 16 else 32 if mean_rows <= 48 else 64


def fused_moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mixture of the chosen experts as grouped GEMMs; see `moe_ref.fused_moe_ref`.

    x [T, H] fp32/bf16/fp16 (any strides), gate_up [E, 2I, H] and down [E, H, I] in x's dtype,
    ids int32/int64 [T, k] (E or any id outside [0, E) = skip route), weights [T, k] any float
    dtype, activation in {"silu", "gelu", "gelu_tanh", "relu"} -> out [T, H] in x's dtype
    (written into `out` when given). fp32 accumulation; the intermediate act(gate) * up is
    rounded to x's dtype between the two GEMMs. No host syncs and no data-dependent shapes,
    so it is safe under CUDA graph capture. No tensor-parallel all-reduce.
    """
    check_moe_triton(x, gate_up, down, ids, weights, activation)
    out = _out(x, out)
    if is_empty(x, ids, down):
        return out.zero_()
    align = align_experts(ids, weights, gate_up.shape[0])
    h = gate_up_gemm(x, gate_up, align, activation, ids.shape[1])
    routed = down_gemm(h, down, align, weights)
    return combine_routes(routed, ids.shape[1], out)


def check_moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
) -> None:
    """The oracle's shape checks plus the kernels' one dtype for x and the weights."""
    check_moe_shapes(x, gate_up, down, ids, weights, activation)
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(
            f"expert weights must be in x's dtype {x.dtype}, got {gate_up.dtype}/{down.dtype}"
        )


def _out(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out


def is_empty(x: torch.Tensor, ids: torch.Tensor, down: torch.Tensor) -> bool:
    """No rows, routes or intermediate width: the output is zero (static shapes: no sync)."""
    return x.shape[0] == 0 or ids.shape[1] == 0 or down.shape[2] == 0


def align_experts(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> MoeAlignment:
    """The routes of ids [T, k] sorted by expert into row blocks sized for the step."""
    return align_routes(ids, weights, num_experts, block_m_for(ids.numel(), num_experts))


def combine_routes(routed: torch.Tensor, top_k: int, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = the fixed-order sum of each token's k weighted routes [T*k, H]."""
    if top_k == 1:
        return out.copy_(routed)
    t, hidden = out.shape
    return out.copy_(torch.sum(routed.view(t, top_k, hidden), dim=1, dtype=torch.float32))


def _precision(dtype: torch.dtype) -> tuple[bool, str | None]:
    """(DOT_F32, PREC): the interpreter cannot dot bf16 operands (module docstring), so it
    upcasts them; fp32 inputs get exact fp32 products (the default would be TF32)."""
    dot_f32 = bool(triton.knobs.runtime.interpret) and dtype == torch.bfloat16
    return dot_f32, "ieee" if dtype == torch.float32 or dot_f32 else None


def gate_up_gemm(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    align: MoeAlignment,
    activation: str,
    top_k: int,
    delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [padded_len, I] = act(gate) * up per padded slot of `align` (padding rows unwritten).
    `delta` [T*k, 2I] (optional, x's dtype): added to each route's gate ‖ up before the
    activation (expert LoRA: moe_lora_triton)."""
    gate_k, _ = _kernels()
    hidden, inter = x.shape[1], gate_up.shape[1] // 2
    num_blocks = align.expert_of_block.numel()
    dot_f32, prec = _precision(x.dtype)
    h = torch.empty(num_blocks * align.block_m, inter, dtype=x.dtype, device=x.device)
    d = h if delta is None else delta  # never read without HAS_DELTA
    gate_k[(num_blocks, triton.cdiv(inter, BLOCK_N))](
        x,
        gate_up,
        h,
        d,
        align.sorted_route_ids,
        align.expert_of_block,
        x.shape[0] * top_k,
        top_k,
        x.stride(0),
        x.stride(1),
        gate_up.stride(0),
        gate_up.stride(1),
        gate_up.stride(2),
        h.stride(0),
        h.stride(1),
        d.stride(0),
        d.stride(1),
        HIDDEN=hidden,
        INTER=inter,
        ACT=_ACT_CODES[activation],
        HAS_DELTA=delta is not None,
        PREC=prec,
        DOT_F32=dot_f32,
        BLOCK_M=align.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        **launch_config.options(MOE_GEMM, "_gate_up_kernel"),
    )
    return h


def down_gemm(
    h: torch.Tensor,
    down: torch.Tensor,
    align: MoeAlignment,
    weights: torch.Tensor,
    delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """routed [T*k, H] = weight * (h W_down^T + delta) per route, in h's dtype (skip and
    zero-weight routes zero). `delta` [T*k, H] (optional, h's dtype): expert LoRA's."""
    _, down_k = _kernels()
    num_routes = weights.numel()
    hidden, inter = down.shape[1], down.shape[2]
    num_blocks = align.expert_of_block.numel()
    dot_f32, prec = _precision(h.dtype)
    # Zeroed: skip routes (and zero-weight ones) are written by no block.
    routed = torch.zeros(num_routes, hidden, dtype=h.dtype, device=h.device)
    d = routed if delta is None else delta  # never read without HAS_DELTA
    # The kernel indexes the weights as a flat unit-stride array by route id; reshape(-1) of
    # a sliced [T, 1] (say weights[:, :1]) is a view with stride 2, so make it contiguous.
    rw = weights.reshape(-1).contiguous()
    down_k[(num_blocks, triton.cdiv(hidden, BLOCK_N))](
        h,
        down,
        routed,
        d,
        align.sorted_route_ids,
        align.expert_of_block,
        rw,
        num_routes,
        h.stride(0),
        h.stride(1),
        down.stride(0),
        down.stride(1),
        down.stride(2),
        routed.stride(0),
        routed.stride(1),
        d.stride(0),
        d.stride(1),
        HIDDEN=hidden,
        INTER=inter,
        HAS_DELTA=delta is not None,
        PREC=prec,
        DOT_F32=dot_f32,
        BLOCK_M=align.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        **launch_config.options(MOE_GEMM, "_down_kernel"),
    )
    return routed
