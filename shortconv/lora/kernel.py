"""Which adapter kernel a model's LoRA layers run, chosen once at build from their device.

On the Triton path (CUDA, or SHORTCONV_KERNELS=triton) the whole delta is the batched
shrink/expand of `kernels.lora_triton` (Punica's SGMV), reading each row's slot and the rows'
alignment by slot, which `LoraBatch` computes once per step (not once per layer: it is the same
for every projection of the step); elsewhere (None) the torch paths of `lora.delta`, as the
step resolved them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch

from shortconv.kernels.dispatch import _triton_or_none
from shortconv.kernels.moe_align import MoeAlignment


class AlignRows(Protocol):
    """Rows of `slots` int [T] sorted by slot into row blocks (slots outside [0, num_slots):
    in none); shapes depend on (T, num_slots) only, so a captured graph can record it."""

    def __call__(self, slots: torch.Tensor, num_slots: int) -> MoeAlignment: ...


class DeltaKernel(Protocol):
    """y [T, out] += (x A[slot, :rank]^T) B[slot, :, :rank]^T per row, in place; slots int64
    [T] (outside [0, num_slots): no adapter); a / b the slot-major LoraSlots views; `align`
    the `AlignRows` of these slots."""

    def __call__(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        slots: torch.Tensor,
        rank: int,
        *,
        align: MoeAlignment,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class LoraKernel:
    """The Triton path's two halves: the per-step alignment and the per-layer delta."""

    align: AlignRows
    delta: DeltaKernel


@dataclass(frozen=True)
class KernelRows:
    """One step's rows as every layer's `LoraKernel.delta` reads them: each row's slot (int64
    [T] on the model's device), the rank to read, and the rows' alignment by slot."""

    slots: torch.Tensor
    rank: int
    align: MoeAlignment


def lora_kernel(device: torch.device) -> LoraKernel | None:
    """The Triton kernels for layers on `device` when it runs the Triton path, else None."""
    # NOTE: the module is imported only here (triton is an optional, dev/GPU-only dependency;
    # dispatch says how to get it), and the functions looked up on it at build, so tests can
    # count them there.
    mod = _triton_or_none(device, "lora_triton")
    if mod is None:
        return None
    return LoraKernel(cast(AlignRows, mod.align_rows), cast(DeltaKernel, mod.lora_delta_triton))
