"""The fused fp32 RMSNorm of our CPU kernel library (`cpu_norm.inc`, built and loaded with the
GEMMs by kernels.cpu_gemm.load), and `rms_norm_ref`, its float64 oracle.

y = x * rsqrt(mean(x^2, last dim) + eps) * weight, each row on its own (batch-invariant: a row's
bits do not depend on the other rows of the call). AVX-512 rows where `set_isa` chose AVX-512,
AVX2 rows otherwise.
"""

from __future__ import annotations

import torch


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x fp32 [..., D] (any strides), weight fp32 [D] -> fp32 [..., D], contiguous. Needs the
    library loaded (kernels.cpu_gemm.load() returned None)."""
    return torch.ops.shortconv_cpu.rms_norm(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same in float64: the mean of squares, the scale and both products, rounded to fp32
    once at the end."""
    h = x.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.double()).float()
