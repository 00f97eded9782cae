"""LoRA on fused routed experts (PEFT's `target_parameters` on `gate_up_proj` / `down_proj`).

For a token row t routed to expert e, with its adapter in slot s:

    gate_up(x) = x W_gu[e]^T + (x A_gu[s, e]^T) B_gu[s, e]^T
    down(h)    = h W_d[e]^T  + (h A_d[s, e]^T)  B_d[s, e]^T

The adapter sits inside the expert (before the activation), so it cannot be added to the
block's output afterwards: `FusedExperts` calls `add` on the rows of each expert it runs.
Each expert's slots are stacked as the dense layers' are (lora.linear.LoraSlots): one shrink
of the rows against every slot's A, a mask that keeps each row's own slot's columns, one
expand (lora.delta.add_stacked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shortconv.kernels import resolve_backend
from shortconv.layers.experts import FusedExperts
from shortconv.lora.batch import LoraBatch
from shortconv.lora.delta import add_stacked


@dataclass(frozen=True)
class ExpertLoraSlots:
    """One fused parameter's ([E, out, in]) resident adapters, B pre-scaled, zero past each
    slot's rank. Stored per expert rank-major, A [E, max_rank, max_loras, in] and B [E, out,
    max_rank, max_loras], so expert e's first `rank` ranks of every slot are one [rank * n,
    in] A and one [out, rank * n] B (`stacked`, views), column rho * n + s being slot s's
    rho-th rank, as lora.step.stack_columns numbers them."""

    a_store: torch.Tensor
    b_store: torch.Tensor
    ranks: list[int]

    @classmethod
    def empty(cls, weight: torch.Tensor, batch: LoraBatch) -> ExpertLoraSlots:
        (e, out_f, in_f), n, r = weight.shape, batch.max_loras, batch.max_rank
        a = torch.zeros(e, r, n, in_f, dtype=weight.dtype, device=weight.device)
        b = torch.zeros(e, out_f, r, n, dtype=weight.dtype, device=weight.device)
        return cls(a, b, [0] * n)

    @property
    def num_experts(self) -> int:
        return self.a_store.shape[0]

    @property
    def max_rank(self) -> int:
        return self.a_store.shape[1]

    def local_shape(self) -> tuple[int, int]:
        """(out, in) of one expert on this rank."""
        return self.b_store.shape[1], self.a_store.shape[3]

    def stacked(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A [E, rank * n, in] and B [E, out, rank * n]: every slot's first `rank` ranks."""
        e, _, n, in_f = self.a_store.shape
        out_f = self.b_store.shape[1]
        a = self.a_store[:, :rank].reshape(e, rank * n, in_f)
        return a, self.b_store[:, :, :rank].reshape(e, out_f, rank * n)

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Put PEFT's stacked pair into `slot`: `a` [r * E, in] (expert-major rows), `b`
        [out, r * E] (rank-major columns), as its ParamWrapper lays them out."""
        e = self.num_experts
        r = a.shape[0] // e
        self.clear(slot)
        self.a_store[:, :r, slot].copy_(a.reshape(e, r, -1))
        self.b_store[:, :, :r, slot].copy_(b.reshape(b.shape[0], r, e).permute(2, 0, 1) * scale)
        self.ranks[slot] = r

    def clear(self, slot: int) -> None:
        self.a_store[:, :, slot].zero_()
        self.b_store[:, :, :, slot].zero_()
        self.ranks[slot] = 0

    def weight_sum(self, slot: int) -> float:
        a, b = self.a_store[:, :, slot], self.b_store[:, :, :, slot]
        return float(a.abs().sum() + b.abs().sum()) + self.ranks[slot]


@dataclass(frozen=True)
class ExpertLoRA:
    """A `FusedExperts`' adapters, bound at build (`bind_expert_lora`). `refusal` says why
    this model's experts cannot take an adapter (an adapter that targets them is refused at
    load: lora.install_experts); None where they can."""

    batch: LoraBatch
    gate_up: ExpertLoraSlots
    down: ExpertLoraSlots
    refusal: str | None

    def step_mask(self) -> torch.Tensor | None:
        """This eager step's [rows, rank * n] column mask (lora.batch), or None when no row's
        slot holds an adapter on these experts: the step then runs the base experts alone."""
        mask = self.batch.expert_mask
        used = self.batch.used_slots
        if mask is None or not any(self.gate_up.ranks[s] or self.down.ranks[s] for s in used):
            return None
        return mask

    def add(
        self, slots: ExpertLoraSlots, y: torch.Tensor, x: torch.Tensor, e: int, mask: torch.Tensor
    ) -> None:
        """y [n, out] += expert e's adapter product of rows x [n, in] whose columns `mask`
        [n, rank * slots] keeps; rows with no adapter (no column kept) are left out."""
        a, b = slots.stacked(mask.shape[1] // self.batch.max_loras)
        keep = mask.any(1).nonzero().squeeze(1)
        if keep.numel() == mask.shape[0]:
            add_stacked(y, x, a[e], b[e], mask)
        elif keep.numel():
            delta = y.new_zeros(keep.numel(), y.shape[1])
            add_stacked(delta, x[keep], a[e], b[e], mask[keep])
            y.index_add_(0, keep, delta)

    def add_every_expert(
        self, slots: ExpertLoraSlots, y: torch.Tensor, x: torch.Tensor, mask: torch.Tensor
    ) -> None:
        """The captured path's: y [E, T, out] += every expert's product of x ([T, in] or [E,
        T, in]) at the full max rank, `mask` [T, max_rank * slots] (fixed shapes, no sync)."""
        a, b = slots.stacked(self.batch.max_rank)
        shrunk = torch.matmul(x, a.transpose(1, 2))
        shrunk.mul_(mask)
        y.add_(torch.matmul(shrunk, b.transpose(1, 2)))


def bind_expert_lora(model: nn.Module, batch: LoraBatch) -> None:
    """Give every `FusedExperts` of `model` its adapter slots (at build, weights unloaded)."""
    for m in model.modules():
        if isinstance(m, FusedExperts):
            refusal = None
            if resolve_backend(m.gate_up_proj.device) == "triton":
                refusal = (
                    "the Triton fused-MoE path (CUDA, SHORTCONV_KERNELS=triton) has no expert LoRA"
                )
            gate_up = ExpertLoraSlots.empty(m.gate_up_proj, batch)
            m.lora = ExpertLoRA(batch, gate_up, ExpertLoraSlots.empty(m.down_proj, batch), refusal)
            batch.experts = True
