"""LoRA on fused routed experts (PEFT's `target_parameters` on `gate_up_proj` / `down_proj`).

For a token row t routed to expert e, with its adapter in slot s:

    gate_up(x) = x W_gu[e]^T + (x A_gu[s, e]^T) B_gu[s, e]^T
    down(h)    = h W_d[e]^T  + (h A_d[s, e]^T)  B_d[s, e]^T

The adapter sits inside the expert (before the activation), so it cannot be added to the
block's output afterwards: `FusedExperts` calls `add` on the rows of each expert it runs.
Each expert's slots are stacked as the dense layers' are (lora.linear.LoraSlots): one shrink
of the rows against every slot's A, a mask that keeps each row's own slot's columns, one
expand (lora.delta.add_stacked).

On the Triton fused-MoE path (CUDA, SHORTCONV_KERNELS=triton) the experts run as one
`moe_lora_triton.fused_moe_lora_triton` instead: each (expert e, slot s) pair is one flat
slot e * max_loras + s of the batched LoRA kernels, so the slots are stored slot-major per
expert there (chosen at bind), and `flat` reads them as [E * max_loras, ...] views.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shortconv.kernels import resolve_backend
from shortconv.kernels.dispatch import _triton_or_none
from shortconv.kernels.moe_lora_ref import ExpertLoraRows
from shortconv.layers.experts import FusedExperts
from shortconv.lora.batch import LoraBatch
from shortconv.lora.delta import add_stacked
from shortconv.lora.kernel import KernelRows


@dataclass(frozen=True)
class ExpertLoraSlots:
    """One fused parameter's ([E, out, in]) resident adapters, B pre-scaled, zero past each
    slot's rank. Stored per expert rank-major, A [E, max_rank, max_loras, in] and B [E, out,
    max_rank, max_loras], so expert e's first `rank` ranks of every slot are one [rank * n,
    in] A and one [out, rank * n] B (`stacked`, views), column rho * n + s being slot s's
    rho-th rank, as lora.step.stack_columns numbers them.

    `flat` (the Triton path's layout, chosen at `empty`): the storage is slot-major per
    expert instead, A [E, n, max_rank, in] and B [E, n, out, max_rank], and `a_store` /
    `b_store` are views of it in the shapes above (loads write through them alike); `flat`
    holds A [E * n, max_rank, in] and B [E * n, out, max_rank], flat slot e * n + s, the
    layout the batched LoRA kernels read. None on the torch path."""

    a_store: torch.Tensor
    b_store: torch.Tensor
    ranks: list[int]
    flat: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def empty(cls, weight: torch.Tensor, batch: LoraBatch, flat: bool = False) -> ExpertLoraSlots:
        (e, out_f, in_f), n, r = weight.shape, batch.max_loras, batch.max_rank
        if not flat:
            a = weight.new_zeros(e, r, n, in_f)
            return cls(a, weight.new_zeros(e, out_f, r, n), [0] * n)
        a_flat = weight.new_zeros(e, n, r, in_f)
        b_flat = weight.new_zeros(e, n, out_f, r)
        views = (a_flat.view(e * n, r, in_f), b_flat.view(e * n, out_f, r))
        return cls(a_flat.permute(0, 2, 1, 3), b_flat.permute(0, 2, 3, 1), [0] * n, views)

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
    load: lora.install_experts); None where they can. `moe_kernel`: the Triton path's
    `fused_moe_lora_triton` (bound at build; the slots then hold the `flat` layout), None on
    the torch path."""

    batch: LoraBatch
    gate_up: ExpertLoraSlots
    down: ExpertLoraSlots
    refusal: str | None
    moe_kernel: Callable[..., torch.Tensor] | None = None

    def step_mask(self) -> torch.Tensor | None:
        """This eager step's [rows, rank * n] column mask (lora.batch), or None when no row's
        slot holds an adapter on these experts: the step then runs the base experts alone."""
        mask = self.batch.expert_mask
        return mask if mask is not None and self._used() else None

    def triton_forward(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        activation: str,
    ) -> torch.Tensor | None:
        """The Triton path's experts with each row's adapter, or None when this step runs
        the base experts alone: an eager step with no adapter on these experts in its rows.
        A graph step always runs it (at the full max rank, from the static slot buffer)."""
        rows = self._kernel_rows(x.shape[0])
        if rows is None:
            return None
        assert self.moe_kernel is not None and self.gate_up.flat and self.down.flat
        lora = ExpertLoraRows(
            *self.gate_up.flat, *self.down.flat, rows.slots, rows.rank, self.batch.max_loras
        )
        return self.moe_kernel(x, gate_up, down, ids, weights, activation, lora)

    def _kernel_rows(self, num_rows: int) -> KernelRows | None:
        if not self.batch.graphed and not self._used():
            return None
        return self.batch.kernel_rows(num_rows)

    def _used(self) -> bool:
        """Some row of this eager step has an adapter that adapts these experts."""
        gu, d = self.gate_up.ranks, self.down.ranks
        return any(gu[s] or d[s] for s in self.batch.used_slots)

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
    """Give every `FusedExperts` of `model` its adapter slots (at build, weights unloaded),
    in the layout of the path its experts run (the Triton fused MoE, or the torch paths)."""
    for m in model.modules():
        if isinstance(m, FusedExperts):
            device = m.gate_up_proj.device
            on_triton = resolve_backend(device) == "triton"
            mod = _triton_or_none(device, "moe_lora_triton") if on_triton else None
            refusal = None
            if on_triton and mod is None:
                refusal = "the fused MoE fell back to its torch reference, which has no LoRA"
            kernel = mod.fused_moe_lora_triton if mod is not None else None
            flat = kernel is not None
            gate_up = ExpertLoraSlots.empty(m.gate_up_proj, batch, flat)
            down = ExpertLoraSlots.empty(m.down_proj, batch, flat)
            m.lora = ExpertLoRA(batch, gate_up, down, refusal, kernel)
            batch.experts = True
