"""RMSNorm with the reference models' exact rounding order (fp32 statistics, weight last)."""

from __future__ import annotations

import torch
from torch import nn

from shortconv.kernels import cpu_gemm
from shortconv.kernels.cpu_norm import rms_norm_cpu
from shortconv.layers.linear import mark_shard


class RMSNorm(nn.Module):
    """Normalises the last dimension (`dim`): x [..., dim] -> the same shape and dtype.

    fp32 calls go to torch.rms_norm, or to our fused CPU kernel once `bind_kernel` chose it at
    build (an fp32 layer on CPU with the library loaded); other dtypes take `reference`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.shape = (dim,)  # rms_norm's normalized_shape, bound once
        self.weight = mark_shard(nn.Parameter(torch.ones(dim)), None)
        self._forward = self._torch_forward

    def bind_kernel(self, use: bool) -> bool:
        """Bind this layer's calls to our fused kernel (`use`, where the weight is fp32 on CPU;
        the library must be loaded) or to torch's path. Returns whether it took ours."""
        use = use and self.weight.dtype == torch.float32 and self.weight.device.type == "cpu"
        if use and not cpu_gemm.loaded():
            raise RuntimeError("RMSNorm.bind_kernel: the CPU kernels are not loaded")
        self._forward = self._kernel_forward if use else self._torch_forward
        return use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # fp32 needs no casts, and the fused op is the same products in the same order
            # (tested bit-equal): one call instead of six small ops. torch.rms_norm is what
            # F.rms_norm calls, without its Python wrapper (45 calls a step at LFM2-350M).
            return torch.rms_norm(x, self.shape, self.weight, self.eps)
        return self.reference(x)

    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        # The weight is fp32 (bound so). One op dispatch and a C++ row loop
        # (kernels/cpu_norm.inc) instead of torch.rms_norm's ~10 ATen ops: ~10 -> ~4 us a call
        # at one row, Module call included. Its fp32 sum of squares is in another order than
        # torch's, so it is close to `reference`, not bit-equal.
        if x.dtype == torch.float32:
            return rms_norm_cpu(x, self.weight, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def bind_rms_norms(model: nn.Module, use_kernel: bool) -> int:
    """Bind every RMSNorm of `model` (built, in its final dtype and device) to our fused CPU
    kernel where `use_kernel` and the layer is fp32 on CPU, else to torch's; returns how many
    took ours."""
    return sum(m.bind_kernel(use_kernel) for m in model.modules() if isinstance(m, RMSNorm))
