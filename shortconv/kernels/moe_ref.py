"""Pure-PyTorch oracle for the fused routed-experts (MoE) kernel.

Routed experts are SwiGLU-style: gate_up `[E, 2I, H]` holds gate ‖ up, down `[E, H, I]`.
Each token t with routes (ids[t, j], weights[t, j]) gets
    out[t] = sum_j weights[t, j] * down_e(act(gate_e x[t]) * up_e x[t]),  e = ids[t, j].
An id equal to E (ZAYA1's skip route) contributes nothing, and neither does a zero weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# Kernel activation names → torch functions with the same math.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "relu": F.relu,
}


def check_moe_shapes(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
) -> None:
    """Host-side shape checks shared by the oracle and the kernel wrapper (no device reads)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    e, two_i, h = gate_up.shape
    if x.dim() != 2 or x.shape[1] != h or two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"expected x [T, H], gate_up [E, 2I, H], down [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(gate_up.shape)}, {tuple(down.shape)}"
        )
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"expected ids and weights [T, k] with T = {x.shape[0]}; "
            f"got {tuple(ids.shape)} and {tuple(weights.shape)}"
        )


def fused_moe_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mixture of the chosen experts, one expert at a time (syncs the host; an oracle).

    x [T, H], gate_up [E, 2I, H], down [E, H, I], ids int [T, k] (E = skip route),
    weights [T, k] any float dtype, activation in ACTIVATIONS -> out [T, H] in x's dtype
    (copied into `out` when given). No tensor-parallel all-reduce (the caller does it).
    """
    check_moe_shapes(x, gate_up, down, ids, weights, activation)
    act = ACTIVATIONS[activation]
    result = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        toks, slots = (ids == e).nonzero(as_tuple=True)
        if toks.numel() == 0:
            continue
        gate, up = (x[toks] @ gate_up[e].t()).chunk(2, dim=-1)
        y = (act(gate) * up) @ down[e].t()
        result.index_add_(0, toks, y * weights[toks, slots, None].to(x.dtype))
    return result if out is None else out.copy_(result)
