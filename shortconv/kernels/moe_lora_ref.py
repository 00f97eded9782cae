"""Pure-PyTorch oracle for the fused MoE with LoRA on its routed experts.

Each (expert e, adapter slot s) pair is one flat SGMV slot `e * num_loras + s`, so the
adapters of every expert are the batched LoRA kernels' slots (`lora_ref` / `lora_triton`).
A route r = t * k + j of token t (slot s = token_slots[t]) to expert e = ids[t, j] runs

    gu[r]  = x[t] W_gu[e]^T + (x[t] A_gu[f]^T) B_gu[f]^T          f = e * num_loras + s
    h[r]   = act(gate) * up                                        (rounded to x's dtype)
    y[r]   = weight[t, j] * (h[r] W_d[e]^T + (h[r] A_d[f]^T) B_d[f]^T)

and out[t] = sum_j y[t * k + j]. A route with no adapter (s outside [0, num_loras)), a skip
route (e outside [0, E)) or a zero weight has no adapter term (f = -1); the last two have no
term at all, as in `moe_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shortconv.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
from shortconv.kernels.moe_ref import ACTIVATIONS, check_moe_shapes


@dataclass(frozen=True)
class ExpertLoraRows:
    """One step's expert adapters as the kernels read them (B pre-scaled, zero past each
    slot's rank; any strides): a_gate_up [E * n, max_rank, H], b_gate_up [E * n, 2I,
    max_rank], a_down [E * n, max_rank, I], b_down [E * n, H, max_rank], flat slot
    e * n + s; token_slots int [T] (outside [0, n): no adapter); the rank to read."""

    a_gate_up: torch.Tensor
    b_gate_up: torch.Tensor
    a_down: torch.Tensor
    b_down: torch.Tensor
    token_slots: torch.Tensor
    rank: int
    num_loras: int


def route_slots(
    ids: torch.Tensor, weights: torch.Tensor, token_slots: torch.Tensor, num_loras: int, e: int
) -> torch.Tensor:
    """int64 [T * k]: each route's flat slot e * num_loras + s, or -1 (no adapter, a skip
    route, a zero weight). Static shapes, no host sync."""
    s = token_slots.reshape(-1, 1).to(torch.int64)
    exp = ids.to(torch.int64)
    live = (s >= 0) & (s < num_loras) & (exp >= 0) & (exp < e) & (weights != 0)
    return torch.where(live, exp * num_loras + s, -1).reshape(-1)


def check_expert_lora(
    lora: ExpertLoraRows, gate_up: torch.Tensor, down: torch.Tensor, num_rows: int
) -> None:
    """Host-side shape checks: flat slots of these experts, the step's rows."""
    e, two_i, h = gate_up.shape
    flat = e * lora.num_loras
    want = {
        "a_gate_up": (flat, h),
        "b_gate_up": (flat, two_i),
        "a_down": (flat, two_i // 2),
        "b_down": (flat, h),
    }
    for name, (slots, width) in want.items():
        got = getattr(lora, name).shape
        if len(got) != 3 or (got[0], got[2 if name.startswith("a") else 1]) != (slots, width):
            raise ValueError(f"{name} must be [{slots}, ...] for {width} features, got {got}")
    if lora.token_slots.shape != (num_rows,):
        raise ValueError(f"token_slots must be [{num_rows}], got {tuple(lora.token_slots.shape)}")


def fused_moe_lora_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
    lora: ExpertLoraRows,
) -> torch.Tensor:
    """`moe_ref.fused_moe_ref` plus each route's expert adapter (module docstring) -> [T, H]
    in x's dtype. Rounds where the kernel does: the adapter terms (lora_ref) and h to x's
    dtype, the rest accumulated in fp32."""
    check_moe_shapes(x, gate_up, down, ids, weights, activation)
    check_expert_lora(lora, gate_up, down, x.shape[0])
    t, k = ids.shape
    num_e = gate_up.shape[0]
    flat = route_slots(ids, weights, lora.token_slots, lora.num_loras, num_e)
    exp = ids.reshape(-1).to(torch.int64)
    routed = (exp >= 0) & (exp < num_e) & (weights.reshape(-1) != 0)
    exp = exp.clamp(0, num_e - 1)
    xr = x.repeat_interleave(k, dim=0)
    gu = torch.bmm(gate_up[exp].float(), xr.float()[:, :, None])[:, :, 0]
    gu += _delta(xr, lora.a_gate_up, lora.b_gate_up, flat, lora.rank).float()
    gate, up = gu.chunk(2, dim=-1)
    h = (ACTIVATIONS[activation](gate) * up).to(x.dtype)
    y = torch.bmm(down[exp].float(), h.float()[:, :, None])[:, :, 0]
    y += _delta(h, lora.a_down, lora.b_down, flat, lora.rank).float()
    y *= torch.where(routed, weights.reshape(-1).float(), 0.0)[:, None]
    return y.view(t, k, -1).sum(1).to(x.dtype)


def _delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, flat: torch.Tensor, rank: int
) -> torch.Tensor:
    s = lora_shrink_ref(x, a, flat, rank)
    return lora_expand_ref(x.new_zeros(x.shape[0], b.shape[1]), s, b, flat)
