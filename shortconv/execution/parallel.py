"""Tensor-parallel context: which rank this is, and the collectives (no-ops at tp_size=1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    size: int = 1
    group: Any = None

    def shard(self, n: int, what: str) -> int:
        """Size of this rank's block of a dimension of length n; refuses uneven splits."""
        if n % self.size:
            raise ValueError(f"tp_size={self.size} does not divide {what} ({n})")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's block along the last dimension (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelContext()
