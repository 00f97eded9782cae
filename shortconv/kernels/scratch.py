"""Reusable work buffers for the CPU attention path, kept by one backend across steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class StepScratch:
    """One backend's reusable work buffers and once-per-step derived tensors (CPU kernels).

    Why: the decode attention's gathered K/V are tens of MB per layer per step; glibc hands
    blocks above its mmap threshold (at most 32 MiB) back to the OS on free, so a fresh tensor
    page-faults all of it again every layer (measured: a 33 MB gather took 19 ms into a fresh
    tensor, 3.3 ms into a reused one). `per_step` values (e.g. head-major gather rows, the
    decode mask bias) are built by the first layer that asks and dropped by `new_step`.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._per_step: dict[object, Any] = {}
        self._constants: dict[object, torch.Tensor] = {}

    def new_step(self) -> None:
        self._per_step.clear()

    def buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat tensor of `numel` elements (like's dtype and device), reused across calls."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype:
            # Why the headroom: decode contexts grow by one token per step, so an exact-size
            # buffer was replaced (and page-faulted afresh) on every step; 1/4 more lasts a
            # 512-token context ~128 steps (measured: 30 ms of a 222 ms batch-32 step).
            size = numel + numel // 4
            buf = self._buffers[name] = torch.empty(size, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def constant(self, key: object, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A read-only tensor kept across steps (e.g. `arange(batch)`): one per key, and keys
        are bounded by the batch sizes a backend sees."""
        value = self._constants.get(key)
        if value is None:
            value = self._constants[key] = build()
        return value

    def per_step(self, key: object, build: Callable[[], T]) -> T:
        value = self._per_step.get(key)
        if value is None:
            value = self._per_step[key] = build()
        return value
