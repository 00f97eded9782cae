"""RMSNorm with the reference models' exact rounding order (fp32 statistics, weight last)."""

from __future__ import annotations

import torch
from torch import nn

from shortconv.layers.linear import mark_shard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mark_shard(nn.Parameter(torch.ones(dim)), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
