"""Triton fused MoE with LoRA on the routed experts; same contract as `moe_lora_ref`.

No new GEMM kernel: each (expert, slot) pair is one flat slot of the batched LoRA kernels
(`lora_triton`'s SGMV shrink/expand), over the T*k route rows. One step, static shapes and
no host sync (graph-capturable):
  1. the routes by expert (`align_experts`, as `moe_triton`) and by flat slot (`align_rows`;
     routes without an adapter, skip and zero-weight routes are in no block: no work);
  2. gate_up's adapter term per route, [T*k, 2I], which `_gate_up_kernel` adds to gate and up
     before the activation (HAS_DELTA);
  3. h read back per route (the padded row each route went to), down's adapter term per
     route, [T*k, H], which `_down_kernel` adds before the route weight (HAS_DELTA);
  4. the fixed-order sum over k, as without adapters.
"""

from __future__ import annotations

import torch

from shortconv.kernels.lora_triton import align_rows, lora_delta_triton
from shortconv.kernels.moe_align import MoeAlignment
from shortconv.kernels.moe_lora_ref import ExpertLoraRows, check_expert_lora, route_slots
from shortconv.kernels.moe_triton import (
    align_experts,
    check_moe_triton,
    combine_routes,
    down_gemm,
    gate_up_gemm,
    is_empty,
)


def route_rows(align: MoeAlignment, num_routes: int) -> torch.Tensor:
    """int64 [T*k]: the padded row of h each route went to (0 for routes in no block, whose
    row nobody reads). A scatter of the sorted route ids, so no sync; the padding's sentinel
    lands in one extra entry, cut off."""
    sorted_ids = align.sorted_route_ids.to(torch.int64)
    rows = torch.zeros(num_routes + 1, dtype=torch.int64, device=sorted_ids.device)
    rows.scatter_(0, sorted_ids, torch.arange(sorted_ids.numel(), device=sorted_ids.device))
    return rows[:num_routes]


def fused_moe_lora_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
    lora: ExpertLoraRows,
) -> torch.Tensor:
    """`moe_triton.fused_moe_triton` plus each route's expert adapter: x [T, H], gate_up
    [E, 2I, H], down [E, H, I] and the adapters in x's dtype, ids / weights [T, k], `lora`
    (moe_lora_ref.ExpertLoraRows, rank <= 64) -> [T, H] in x's dtype, fp32 accumulation; the
    adapter terms are rounded to x's dtype, as `lora_triton` rounds them."""
    check_moe_triton(x, gate_up, down, ids, weights, activation)
    check_expert_lora(lora, gate_up, down, x.shape[0])
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if is_empty(x, ids, down):
        return out.zero_()
    top_k, num_e = ids.shape[1], gate_up.shape[0]
    num_routes = ids.numel()
    align = align_experts(ids, weights, num_e)
    slots = route_slots(ids, weights, lora.token_slots, lora.num_loras, num_e)
    by_slot = align_rows(slots, num_e * lora.num_loras)
    xr = x.repeat_interleave(top_k, dim=0)
    d_gu = x.new_zeros(num_routes, gate_up.shape[1])
    lora_delta_triton(d_gu, xr, lora.a_gate_up, lora.b_gate_up, slots, lora.rank, align=by_slot)
    h = gate_up_gemm(x, gate_up, align, activation, top_k, d_gu)
    hr = h[route_rows(align, num_routes)]
    d_down = x.new_zeros(num_routes, down.shape[1])
    lora_delta_triton(d_down, hr, lora.a_down, lora.b_down, slots, lora.rank, align=by_slot)
    return combine_routes(down_gemm(h, down, align, weights, d_down), top_k, out)
