"""Our AVX2 fp32 kernel (kernels/cpu_gemm) for small batches, a float method above them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shortconv.kernels.cpu_gemm import gemm_f32
from shortconv.layers.linear_method import LinearLayer, LinearMethod

# Rows up to which fp32 linears take our tile by default (the AVX2 row of
# layers.linear_rows.MEASURED_TILE_ROWS); the engine binds each machine's own threshold from
# that table, `larger` above it.
CPU_GEMM_MAX_ROWS = 64


@dataclass(frozen=True)
class CpuGemmLinear(LinearMethod):
    """A CPU fp32 inference weight: batches of up to `max_rows` rows through our tile (it
    reads the weight faster than torch's paths there), larger ones through `larger` (torch's
    linear). `max_rows` comes from linear_rows' table per tile set, bound at build."""

    larger: LinearMethod
    max_rows: int = CPU_GEMM_MAX_ROWS
    name: str = "cpu_gemm"

    def process_after_load(self, layer: LinearLayer) -> None:
        self.larger.process_after_load(layer)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.numel() > self.max_rows * x.shape[-1]:
            return self.larger.apply(layer, x, bias)
        flat = x.reshape(-1, x.shape[-1])
        return gemm_f32(flat, layer.weight, bias).view(*x.shape[:-1], layer.weight.shape[0])

    def onednn_weight(self, layer: LinearLayer, rows: int) -> torch.Tensor | None:
        return self.larger.onednn_weight(layer, rows)
