"""Which adapter kernel a LoRA layer runs, chosen once at build from its weight's device.

On the Triton path (CUDA, or SHORTCONV_KERNELS=triton) the whole delta is the batched
shrink/expand of `kernels.lora_triton` (Punica's SGMV), reading each row's slot; elsewhere
(None) the torch paths of `lora.delta`, as the step resolved them.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from shortconv.kernels.dispatch import _triton_or_none


class DeltaKernel(Protocol):
    """y [T, out] += (x A[slot, :rank]^T) B[slot, :, :rank]^T per row, in place; slots int64
    [T] (outside [0, num_slots): no adapter); a / b the slot-major LoraSlots views."""

    def __call__(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        slots: torch.Tensor,
        rank: int,
    ) -> torch.Tensor: ...


def delta_kernel(device: torch.device) -> DeltaKernel | None:
    """The Triton delta for layers on `device` when it runs the Triton path, else None."""
    # NOTE: the module is imported only here (triton is an optional, dev/GPU-only dependency;
    # dispatch says how to get it), and the function looked up on it at build, so tests can
    # count it there.
    mod = _triton_or_none(device, "lora_triton")
    return None if mod is None else cast(DeltaKernel, mod.lora_delta_triton)
