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


@dataclass
class LoraSlots:
    """One layer's resident adapters: A [max_loras + 1, max_rank, in], B [max_loras + 1, out,
    max_rank] (zero past each slot's rank; the last slot, `LoraBatch.zero_slot`, always zero),
    and each slot's rank (0: empty)."""

    a: torch.Tensor
    b: torch.Tensor
    ranks: list[int]

    @classmethod
    def empty(cls, weight: torch.Tensor, batch: LoraBatch) -> LoraSlots:
        """Empty slots for a layer whose (float, as loaded) weight is `weight` [out, in]."""
        (out_f, in_f), n, r = weight.shape, batch.max_loras + 1, batch.max_rank
        a = torch.zeros(n, r, in_f, dtype=weight.dtype, device=weight.device)
        b = torch.zeros(n, out_f, r, dtype=weight.dtype, device=weight.device)
        return cls(a, b, [0] * n)


class LoraLayer(LinearLayer, Protocol):
    """A linear layer as LoRALinear sees it: its slot for the adapters too."""

    lora: LoraSlots | None


@dataclass(frozen=True)
class LoRALinear(LinearMethod):
    """`base` plus the adapters of the step's rows (`batch`, set once per step by the runner).

    The eager path groups rows by adapter (the groups are made once per step) and runs two
    small GEMMs per group, sliced to the slot's own rank, so zero padding costs nothing. A
    graph step gathers each row's A and B by its slot in the static `token_slots` (shrink,
    then expand, at the full max rank): fixed shapes, no host sync, so it captures."""

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
        if self.batch.graphed:
            return y + _gathered_delta(self.batch, slots, x).view(y.shape).to(y.dtype)
        if not self.batch.groups:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for g in self.batch.groups:
            r = slots.ranks[g.slot]
            if r:
                xs = flat_x.index_select(0, g.rows).to(slots.a.dtype)
                delta = (xs @ slots.a[g.slot, :r].t()) @ slots.b[g.slot, :, :r].t()
                flat_y.index_add_(0, g.rows, delta.to(y.dtype))
        return y

    def onednn_weight(self, layer: LinearLayer, rows: int) -> torch.Tensor | None:
        return None  # NOTE: a fused SwiGLU would skip the adapter; keep the two calls apart


def _gathered_delta(batch: LoraBatch, slots: LoraSlots, x: torch.Tensor) -> torch.Tensor:
    """(x A[s]^T) B[s]^T for every row, s its slot in the static `token_slots`: [T, out]."""
    flat_x = x.reshape(-1, x.shape[-1]).to(slots.a.dtype)
    assert batch.token_slots is not None, "graph steps need LoraBatch.reserve"
    idx = batch.token_slots[: flat_x.shape[0]]
    shrunk = torch.bmm(slots.a.index_select(0, idx), flat_x.unsqueeze(2))  # [T, r, 1]
    return torch.bmm(slots.b.index_select(0, idx), shrunk).squeeze(2)  # [T, out]
