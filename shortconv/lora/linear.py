"""The LoRA linear method: a base method's output plus each row's adapter product.

    y = base.apply(layer, x, bias) + (x A[s]^T) B[s]^T   for the rows of each adapter slot s

B is stored pre-scaled (alpha/r, or alpha/sqrt(r) with rsLoRA), so no scale is applied per
call. The adapter weights are the layer's (`layer.lora`), in the model dtype, beside whatever
layout the base keeps (a q8 base keeps its int8 weight: the adapter stays float).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, cast

import torch

from shortconv.layers.linear_method import LinearLayer, LinearMethod
from shortconv.lora.batch import LoraBatch
from shortconv.lora.delta import add_grouped, add_stacked


@dataclass(frozen=True)
class LoraSlots:
    """One layer's resident adapters, zero past each slot's rank, and each slot's rank (0:
    empty). Stored rank-major, A as [max_rank, max_loras, in] and B as [out, max_rank,
    max_loras], so the first `rank` rows of every slot's A are one contiguous [rank *
    max_loras, in] matrix and B's the matching [out, rank * max_loras] one (`stacked`): a
    step reads all slots in one GEMM each way, with no per-step copy or transpose.
    `a` [max_loras, max_rank, in] and `b` [max_loras, out, max_rank] are slot-major views of
    the same storage (loads, unloads and the grouped path write and read them, and so do the
    Triton kernels)."""

    a_store: torch.Tensor
    b_store: torch.Tensor
    ranks: list[int]

    @classmethod
    def empty(cls, weight: torch.Tensor, batch: LoraBatch) -> LoraSlots:
        """Empty slots for a layer whose (float, as loaded) weight is `weight` [out, in]."""
        (out_f, in_f), n, r = weight.shape, batch.max_loras, batch.max_rank
        a = torch.zeros(r, n, in_f, dtype=weight.dtype, device=weight.device)
        b = torch.zeros(out_f, r, n, dtype=weight.dtype, device=weight.device)
        return cls(a, b, [0] * n)

    @property
    def a(self) -> torch.Tensor:
        return self.a_store.transpose(0, 1)

    @property
    def b(self) -> torch.Tensor:
        return self.b_store.permute(2, 0, 1)

    def stacked(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's first `rank` ranks: A [rank * n, in] and B [out, rank * n] (column
        rho * n + s is slot s's rho-th rank: lora.step.stack_columns), both views."""
        _, n, in_f = self.a_store.shape
        out_f = self.b_store.shape[0]
        a = self.a_store[:rank].view(rank * n, in_f)
        return a, self.b_store[:, :rank].view(out_f, rank * n)


class LoraLayer(LinearLayer, Protocol):
    """A linear layer as LoRALinear sees it: its slot for the adapters too."""

    lora: LoraSlots | None


@dataclass(frozen=True)
class LoRALinear(LinearMethod):
    """`base` plus the adapters of the step's rows (`batch`, set once per step by the runner).

    How the rows meet their adapters is the step's (`LoraBatch.step`, resolved once per step:
    stacked for decode-sized steps, grouped for long ones; lora.step), never decided here. A
    graph step runs the stacked path from the static `token_slots` at the full max rank:
    fixed shapes, no host sync, so it captures. The delta is added into the base's output in
    place (lora.delta). On the Triton path (the batch's `kernel`, bound at build) the kernel
    does the whole delta from the step's `KernelRows` instead (lora.kernel)."""

    base: LinearMethod
    batch: LoraBatch = field(compare=False)
    name: str = "lora"

    def process_after_load(self, layer: LinearLayer) -> None:
        # Sized from the float weight before the base may drop it (q8); the base's layout
        # never sees the adapter (a q8 base quantizes W alone).
        cast(LoraLayer, layer).lora = LoraSlots.empty(layer.weight, self.batch)
        self.base.process_after_load(layer)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias)
        slots = cast(LoraLayer, layer).lora
        if slots is None:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        kernel = self.batch.kernel
        if kernel is not None:
            rows = self.batch.kernel_rows(flat_x.shape[0])
            if rows is not None:
                kernel.delta(
                    flat_y, flat_x, slots.a, slots.b, rows.slots, rows.rank, align=rows.align
                )
            return y
        step = self.batch.graph_step(flat_x.shape[0]) if self.batch.graphed else self.batch.step
        if step is None:
            return y
        if step.mask is not None:
            a, b = slots.stacked(step.rank)
            add_stacked(flat_y, flat_x, a, b, step.mask)
        else:
            add_grouped(flat_y, flat_x, slots.a, slots.b, slots.ranks, step.groups)
        return y

    def onednn_weight(self, layer: LinearLayer, rows: int) -> torch.Tensor | None:
        return None  # NOTE: a fused SwiGLU would skip the adapter; keep the two calls apart
