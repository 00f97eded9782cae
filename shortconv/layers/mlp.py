"""SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

from __future__ import annotations

import torch
from torch import nn

from shortconv.execution.parallel import ParallelContext
from shortconv.layers.linear import ColumnParallelLinear, RowParallelLinear, silu_mul


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int, tp: ParallelContext):
        super().__init__()
        self.w1 = ColumnParallelLinear(hidden, inter, False, tp)
        self.w3 = ColumnParallelLinear(hidden, inter, False, tp)
        self.w2 = RowParallelLinear(inter, hidden, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(silu_mul(x, self.w1, self.w3))
