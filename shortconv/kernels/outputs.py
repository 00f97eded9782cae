"""Output tensors of the short-conv and CCA kernels (torch and Triton alike)."""

from __future__ import annotations

import torch


def out_like(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """An output [rows, cols] in x's dtype and major order: a token-major view stays
    token-major, so stores coalesce and the caller's transpose back is free."""
    if x.dim() == 2 and x.stride(0) == 1 and x.stride(1) != 1:
        return torch.empty(cols, rows, dtype=x.dtype, device=x.device).t()
    return torch.empty(rows, cols, dtype=x.dtype, device=x.device)


def decode_out(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The decode kernels' output [B, C]: `out` when given, else a new tensor like x."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
