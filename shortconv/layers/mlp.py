"""SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shortconv.layers.linear import ColumnParallelLinear, RowParallelLinear
from shortconv.parallel import ParallelContext


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int, tp: ParallelContext):
        super().__init__()
        self.w1 = ColumnParallelLinear(hidden, inter, False, tp)
        self.w3 = ColumnParallelLinear(hidden, inter, False, tp)
        self.w2 = RowParallelLinear(inter, hidden, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
