"""Column-, row- and replicated linear layers whose parameters know how to take their shard.

Each layer computes through its `method` (layers.linear_method), bound once at build by
layers.linear_binding; until then (a layer built outside `build_model`) it is plain F.linear.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shortconv.execution.parallel import ParallelContext
from shortconv.kernels.cpu_gemm import Q8Weight
from shortconv.kernels.cpu_gemm_q4 import Q4Weight
from shortconv.kernels.cpu_gemm_q6 import Q6Weight
from shortconv.layers.linear_float import FLOAT
from shortconv.layers.linear_method import LinearMethod, PackedWeight
from shortconv.layers.shard import load_shard_, mark_rows, mark_shard

if TYPE_CHECKING:
    from shortconv.lora.linear import LoraSlots

__all__ = [
    "ColumnParallelLinear",
    "ColumnSliceLinear",
    "LinearBase",
    "ReplicatedLinear",
    "RowParallelLinear",
    "load_shard_",
    "mark_rows",
    "mark_shard",
    "silu_mul",
]

# Rows from which SwiGLU fuses silu and the gate product into oneDNN's GEMMs (post-ops): 1.14x
# on the LFM2-350M MLP at 512 rows (prefill), a wash at decode sizes.
FUSED_SWIGLU_MIN_ROWS = 64


class LinearBase(nn.Module):
    """A linear layer: `weight` [out, in] (this rank's shard, in the checkpoint's float layout
    until its method's `process_after_load`), optional `bias`, and the one `method` that
    computes it. What the method derives from the weight lives here too."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    method: LinearMethod = FLOAT
    #: The model's output head: quantized only when asked (EngineConfig.quantize_lm_head).
    is_lm_head: bool = False
    blocked: PackedWeight | None = None  # OneDnnLinear's prepacked copy
    q8: Q8Weight | None = None  # Q8Linear's weight
    q4: Q4Weight | None = None  # Q4Linear's weight
    q6: Q6Weight | None = None  # Q6Linear's weight
    lora: LoraSlots | None = None  # LoRALinear's adapter slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


def silu_mul(x: torch.Tensor, gate: LinearBase, up: LinearBase) -> torch.Tensor:
    """silu(gate(x)) * up(x) for x [T, H] (bias-free layers); both products and the gating in
    two oneDNN calls (swish and multiply post-ops) when both methods run on oneDNN and T is
    large enough."""
    if x.dim() == 2 and x.shape[0] >= FUSED_SWIGLU_MIN_ROWS:
        wg = gate.method.onednn_weight(gate, x.shape[0])
        wu = up.method.onednn_weight(up, x.shape[0])
        if wg is not None and wu is not None:
            g = torch.ops.mkldnn._linear_pointwise(x, wg, None, "swish", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, g, wu, None, "mul")
    return F.silu(gate(x)) * up(x)


class ColumnParallelLinear(LinearBase):
    """y = x W^T (+ b); each rank holds out_features/tp rows (per packed part)."""

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: ParallelContext, parts: int = 1):
        super().__init__()
        out_local = tp.shard(out_f // parts, "output features") * parts
        self.weight = mark_shard(nn.Parameter(torch.empty(out_local, in_f)), 0, parts)
        self.bias = mark_shard(nn.Parameter(torch.empty(out_local)), 0, parts) if bias else None


class RowParallelLinear(LinearBase):
    """y = all_reduce(x_shard W_shard^T) + b; each rank holds in_features/tp columns."""

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: ParallelContext):
        super().__init__()
        self.tp = tp
        self.weight = mark_shard(
            nn.Parameter(torch.empty(out_f, tp.shard(in_f, "input features"))), 1
        )
        self.bias = mark_shard(nn.Parameter(torch.empty(out_f)), None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.method.apply(self, x, None))
        # NOTE: bias after the reduction, so it is added once, not tp_size times.
        return y + self.bias if self.bias is not None else y


class ColumnSliceLinear(LinearBase):
    """y = x W[rows]^T (+ b[rows]): the output rows `rows` ([start, stop) ranges of the full
    weight, concatenated) that this rank needs, e.g. the KV heads its query heads use, which
    several ranks may hold alike (replicated) or which may be empty on a rank (ZAYA1's
    previous-token values live on the ranks holding those heads only)."""

    def __init__(self, in_f: int, rows: tuple[tuple[int, int], ...], bias: bool):
        super().__init__()
        n = sum(stop - start for start, stop in rows)
        self.weight = mark_rows(nn.Parameter(torch.empty(n, in_f)), 0, rows)
        self.bias = mark_rows(nn.Parameter(torch.empty(n)), 0, rows) if bias else None


class ReplicatedLinear(LinearBase):
    def __init__(self, in_f: int, out_f: int, bias: bool):
        super().__init__()
        self.weight = mark_shard(nn.Parameter(torch.empty(out_f, in_f)), None)
        self.bias = mark_shard(nn.Parameter(torch.empty(out_f)), None) if bias else None
