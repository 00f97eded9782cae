"""Routed experts (SwiGLU per expert) stored fused as the reference checkpoints store them."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from shortconv.execution.parallel import ParallelContext
from shortconv.kernels.bound import bind_kernels
from shortconv.kernels.moe_ref import ACTIVATIONS
from shortconv.layers.linear import mark_shard
from shortconv.layers.linear_float import dense_linear

# When the experts run as two batched matmuls over a padded [E, rows, H] layout instead of a
# loop over the experts that have tokens: with at most PADDED_MAX_ROWS tokens on any expert
# (below ~20 rows, 2 FLOPs per weight element per row against the ~44 a CPU's compute/bandwidth
# balance allows, an expert's GEMM is bound by reading its weights, so padded rows cost nothing)
# and at least PADDED_MIN_ACTIVE of the experts in use (the batched matmuls read every expert's
# weights; the loop reads only the used ones but pays ~8 small ops each). Measured on ZAYA1-100M
# experts (16 x 512 -> 512, 2 cores): loop ~0.47 ms per used expert, padded ~4.3 ms for all 16;
# 14 of 16 used (decode batch 32): padded 4.1 vs loop 6.5 ms; 8 of 16: 4.1 vs 3.7 ms.
PADDED_MAX_ROWS = 16
PADDED_MIN_ACTIVE = 2 / 3


class ExpertAdapters(Protocol):
    """What FusedExperts calls on the adapters bound to it (lora.experts.ExpertLoRA): a
    protocol, so that layers import nothing of lora (lora builds on layers)."""

    @property
    def batch(self) -> Any: ...  # lora.batch.LoraBatch

    @property
    def gate_up(self) -> Any: ...  # lora.experts.ExpertLoraSlots

    @property
    def down(self) -> Any: ...

    def step_mask(self) -> torch.Tensor | None: ...

    def triton_forward(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        activation: str,
    ) -> torch.Tensor | None: ...

    def add(
        self, slots: Any, y: torch.Tensor, x: torch.Tensor, e: int, mask: torch.Tensor
    ) -> None: ...

    def add_every_expert(
        self, slots: Any, y: torch.Tensor, x: torch.Tensor, mask: torch.Tensor
    ) -> None: ...


class FusedExperts(nn.Module):
    """gate_up `[E, 2I, H]` (gate ‖ up), down `[E, H, I]`; TP shards I, then all-reduces.

    `forward(x[T,H], ids[T,k], weights[T,k])` → `[T,H]`; ids equal to `num_experts` or weight 0
    contribute nothing (ZAYA1's skip route).

    `activation` is a kernel activation name (`moe_ref.ACTIVATIONS`). On the Triton backend
    (CUDA, or SHORTCONV_KERNELS=triton) every call is one static-shape `fused_moe`, graph-safe
    as is. On the torch backend `capture_safe` (set by the graph runner while it captures or
    replays a decode step) selects a fixed-shape path with no host sync; it equals the grouped
    path within fp32 rounding.

    `lora` (bound at build with enable_lora: lora.experts) adds each row's adapter inside the
    experts it is routed to; on the torch backend an eager step with adapter rows runs the
    per-expert loop, on the Triton backend the fused MoE with the adapters' terms
    (`moe_lora_triton`) whenever a row has one (every graph step).
    """

    capture_safe: bool = False
    lora: ExpertAdapters | None = None

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        tp: ParallelContext,
        activation: str = "silu",
    ):
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        i_local = tp.shard(inter, "expert intermediate size")
        self.gate_up_proj = mark_shard(
            nn.Parameter(torch.empty(num_experts, 2 * i_local, hidden)), 1, parts=2
        )
        self.down_proj = mark_shard(nn.Parameter(torch.empty(num_experts, hidden, i_local)), 2)
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.kernels = bind_kernels()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.kernels.backend == "triton":
            y = None
            if self.lora is not None:
                gu, down = self.gate_up_proj, self.down_proj
                y = self.lora.triton_forward(x, gu, down, ids, weights, self.activation)
            if y is None:
                y = self.kernels.fused_moe(
                    x, self.gate_up_proj, self.down_proj, ids, weights, self.activation
                )
            return self.tp.all_reduce(y)
        if self.capture_safe:
            return self.tp.all_reduce(self._forward_dense(x, ids, weights))
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        # NOTE: one host sync per layer to size the groups; a graph-captured decode uses the
        # dense path below instead.
        bins = torch.bincount(flat_ids, minlength=self.num_experts + 1)
        counts = bins.tolist()
        token_of = order // ids.shape[1]
        w_sorted = weights.reshape(-1)[order]
        cap = max(counts[: self.num_experts])
        active = sum(1 for n in counts[: self.num_experts] if n)
        # A step with adapter rows on these experts takes the loop: the padded bmm reads no
        # per-row adapter.
        mask = self.lora.step_mask() if self.lora is not None else None
        padded = 0 < cap <= PADDED_MAX_ROWS and active >= PADDED_MIN_ACTIVE * self.num_experts
        if padded and mask is None:
            y, dest = self._padded(x, flat_ids[order], bins, token_of, cap)
            out.index_add_(0, token_of[dest], y * w_sorted[dest, None].to(x.dtype))
            return self.tp.all_reduce(out)
        start = 0
        for e, n in enumerate(counts[: self.num_experts]):
            if n:
                toks = token_of[start : start + n]
                y = self._expert(x[toks], e, mask[toks] if mask is not None else None)
                out.index_add_(0, toks, y * w_sorted[start : start + n, None].to(x.dtype))
            start += n
        return self.tp.all_reduce(out)

    def _padded(
        self,
        x: torch.Tensor,
        sorted_ids: torch.Tensor,
        bins: torch.Tensor,
        token_of: torch.Tensor,
        cap: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert at once: routed rows (sorted by expert) placed into `[E, cap, H]`, two
        `bmm`s. Returns each routed row's output and its index into the sorted routes (skip
        routes left out)."""
        e = self.num_experts
        starts = torch.cumsum(bins, 0) - bins
        dest = (sorted_ids < e).nonzero().squeeze(1)  # sorted routes that reach an expert
        expert = sorted_ids[dest]
        slot = expert * cap + dest - starts[expert]
        rows = x.new_zeros(e * cap, x.shape[1]).index_copy_(0, slot, x[token_of[dest]])
        gate, up = torch.bmm(rows.view(e, cap, -1), self.gate_up_proj.transpose(1, 2)).chunk(
            2, dim=-1
        )
        y = torch.bmm(self.act(gate) * up, self.down_proj.transpose(1, 2))  # [E, cap, H]
        return y.view(e * cap, -1)[slot], dest

    def _forward_dense(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        # Every expert runs on every token and a [T, E] combine matrix zeroes the unchosen ones:
        # shapes depend on T only, so a CUDA graph can capture it. Decode is bound by reading the
        # expert weights, which a decode batch touches almost entirely either way.
        combine = x.new_zeros(x.shape[0], self.num_experts + 1, dtype=weights.dtype)
        combine.scatter_add_(1, ids, weights)  # the skip id lands in the extra, dropped column
        gate_up = torch.matmul(x, self.gate_up_proj.transpose(1, 2))
        lora = self.lora if self.lora is not None and self.lora.batch.graphed else None
        mask = lora.batch.graph_step(x.shape[0]).mask if lora is not None else None
        if lora is not None and mask is not None:
            lora.add_every_expert(lora.gate_up, gate_up, x, mask)
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act(gate) * up
        y = torch.matmul(h, self.down_proj.transpose(1, 2))  # [E, T, H]
        if lora is not None and mask is not None:
            lora.add_every_expert(lora.down, y, h, mask)
        w = combine[:, : self.num_experts].t().to(x.dtype)  # [E, T]
        return (y * w[:, :, None]).sum(0)

    def _expert(self, x: torch.Tensor, e: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Expert e on rows x; `mask` (its rows of the step's LoRA column mask) adds their
        adapters to both projections."""
        gate_up = dense_linear(x, self.gate_up_proj[e])
        if self.lora is not None and mask is not None:
            self.lora.add(self.lora.gate_up, gate_up, x, e, mask)
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act(gate) * up
        y = dense_linear(h, self.down_proj[e])
        if self.lora is not None and mask is not None:
            self.lora.add(self.lora.down, y, h, e, mask)
        return y
