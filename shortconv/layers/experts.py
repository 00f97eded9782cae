"""Routed experts (SwiGLU per expert) stored fused as the reference checkpoints store them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shortconv.layers.linear import mark_shard
from shortconv.parallel import ParallelContext


class FusedExperts(nn.Module):
    """gate_up `[E, 2I, H]` (gate ‖ up), down `[E, H, I]`; TP shards I, then all-reduces.

    `forward(x[T,H], ids[T,k], weights[T,k])` → `[T,H]`; ids equal to `num_experts` or weight 0
    contribute nothing (ZAYA1's skip route).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        tp: ParallelContext,
        act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    ):
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        i_local = tp.shard(inter, "expert intermediate size")
        self.gate_up_proj = mark_shard(
            nn.Parameter(torch.empty(num_experts, 2 * i_local, hidden)), 1, parts=2
        )
        self.down_proj = mark_shard(nn.Parameter(torch.empty(num_experts, hidden, i_local)), 2)
        self.act = act

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        # NOTE: one host sync per layer to size the groups; a graph-captured decode uses the
        # dense path below instead.
        counts = torch.bincount(flat_ids, minlength=self.num_experts + 1).tolist()
        token_of = order // ids.shape[1]
        w_sorted = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts[: self.num_experts]):
            if n:
                toks = token_of[start : start + n]
                y = self._expert(x[toks], e) * w_sorted[start : start + n, None].to(x.dtype)
                out.index_add_(0, toks, y)
            start += n
        return self.tp.all_reduce(out)

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[e])
