"""The quantized linear methods (`EngineConfig.quantization`: "int8" is q8, "int4" is q4 with
the LM head and Q4_K_M's ffn_down layers in q6: layers.linear_binding) and the weight-bytes report.

q8 (kernels/cpu_gemm): int8 weights with one fp32 scale per 32 consecutive weights of a row.
q4 (kernels/cpu_gemm_q4): 4-bit codes with an fp16 scale and min per 32 weights of a row.
q6 (kernels/cpu_gemm_q6): 6-bit codes with an fp16 scale per 32 weights of a row.
`process_after_load` runs on each rank after its shard is loaded, so each weight is quantized
once per rank. A block never straddles two ranks: column-parallel ranks hold whole rows, and a
row-parallel shard starts at a multiple of its width, which must be a multiple of 32 (both
formats; checked when the method is bound, with the layer named: layers.linear_binding), so TP
ranks hold exactly TP 1's integers and scales, split. The float weight is dropped unless
another module shares it (an embedding tied to the LM head keeps its rows for lookups).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from shortconv.kernels.cpu_gemm import gemm_q8, quantize_q8
from shortconv.kernels.cpu_gemm_q4 import gemm_q4, quantize_q4
from shortconv.kernels.cpu_gemm_q6 import gemm_q6, quantize_q6
from shortconv.layers.linear import LinearBase
from shortconv.layers.linear_method import LinearLayer, LinearMethod


@dataclass(frozen=True)
class Q8Linear(LinearMethod):
    """x W^T for a q8 weight, at every batch size through the AVX2 kernel: its int16 x int8
    sums measured faster than widening the weight to fp32 for oneDNN even at 256 rows (1.5x),
    and faster than fp32 oneDNN on the float weights (1.2-1.6x). `keep_float`: the float
    weight is shared with another module and stays."""

    keep_float: bool = False
    name: str = "q8"

    def process_after_load(self, layer: LinearLayer) -> None:
        layer.q8 = quantize_q8(layer.weight)
        _drop_float(layer, self.keep_float)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert layer.q8 is not None, "Q8Linear.apply before process_after_load"
        return _apply(gemm_q8, layer.q8, x, bias)


@dataclass(frozen=True)
class Q4Linear(LinearMethod):
    """x W^T for a q4 weight, at every batch size through our AVX2 q4 kernel: torch 2.14's CPU
    int4 matmul took 48-69x our q8 kernel's CPU time at 1-32 rows (bench/int4_gemm.py).
    `keep_float` as for Q8Linear."""

    keep_float: bool = False
    name: str = "q4"

    def process_after_load(self, layer: LinearLayer) -> None:
        layer.q4 = quantize_q4(layer.weight)
        _drop_float(layer, self.keep_float)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert layer.q4 is not None, "Q4Linear.apply before process_after_load"
        return _apply(gemm_q4, layer.q4, x, bias)


@dataclass(frozen=True)
class Q6Linear(LinearMethod):
    """x W^T for a q6 weight (6-bit codes, fp16 scale per 32), at every batch size through our
    q6 kernel: int4's LM head and ffn_down in Q4_K_M's layers, where it keeps Q6_K
    (docs/quantization.md). `keep_float` as
    for Q8Linear."""

    keep_float: bool = False
    name: str = "q6"

    def process_after_load(self, layer: LinearLayer) -> None:
        layer.q6 = quantize_q6(layer.weight)
        _drop_float(layer, self.keep_float)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert layer.q6 is not None, "Q6Linear.apply before process_after_load"
        return _apply(gemm_q6, layer.q6, x, bias)


class _QuantizedWeight(Protocol):
    @property
    def out_features(self) -> int: ...


def _apply(
    gemm: Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor],
    qw: _QuantizedWeight,
    x: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [..., in] through a quantized kernel that takes fp32 rows [T, in]."""
    if x.dtype == torch.float32 and x.dim() == 2:
        return gemm(x, qw, bias)  # see _fp32_rows
    y = gemm(x.reshape(-1, x.shape[-1]).float(), qw, bias)
    return y.to(x.dtype).view(*x.shape[:-1], qw.out_features)


# NOTE (_fp32_rows): fp32 rows [T, K] (every linear of an fp32 model) go straight to the
# kernel: the reshape, .float(), .to(x.dtype) and .view of the general path are identities
# there, but 4 tensor ops a call, 92 calls a step at LFM2-350M, were measured host time of a
# batch-1 decode step (bench/profile_step.py --cprofile).


def _drop_float(layer: LinearLayer, keep: bool) -> None:
    if not keep:
        # An empty tensor keeps the attribute (and its dtype); the quantized copy is the only one.
        layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of `model`'s weights on this rank by storage dtype (int8 weights with their fp32
    scales under "int8", q4 codes with their scales and mins under "int4", q6 codes with their
    scales under "int6"); a tensor shared by
    two modules (a tied LM head) counts once."""
    out: Counter[str] = Counter()
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen and p.numel():
            seen.add(id(p))
            out[str(p.dtype).removeprefix("torch.")] += p.numel() * p.element_size()
    for mod in model.modules():
        if isinstance(mod, LinearBase) and mod.q8 is not None:
            out["int8"] += mod.q8.nbytes
        if isinstance(mod, LinearBase) and mod.q4 is not None:
            out["int4"] += mod.q4.nbytes
        if isinstance(mod, LinearBase) and mod.q6 is not None:
            out["int6"] += mod.q6.nbytes
    return dict(out)
