"""The q4/q6/q8 methods' fp32 rows path (straight to the kernel) against their general path."""

from __future__ import annotations

import shutil

import pytest
import torch

from shortconv.kernels import cpu_gemm as cg
from shortconv.kernels.cpu_gemm import gemm_q8_ref
from shortconv.kernels.cpu_gemm_q4 import gemm_q4_ref, q4_int8_activations
from shortconv.kernels.cpu_gemm_q6 import gemm_q6_ref
from shortconv.layers.linear import ReplicatedLinear
from shortconv.layers.linear_method import LinearMethod
from shortconv.layers.quantize import Q4Linear, Q6Linear, Q8Linear

pytestmark = pytest.mark.skipif(
    not (cg.cpu_has_avx2_fma() and (shutil.which("c++") or shutil.which("g++"))),
    reason="needs an AVX2/FMA CPU and a C++ compiler",
)


@pytest.mark.parametrize("method", [Q4Linear(), Q6Linear(), Q8Linear()], ids=lambda m: m.name)
@pytest.mark.parametrize("rows", [1, 5])
def test_fp32_rows_equal_the_general_path(method: LinearMethod, rows: int) -> None:
    """[T, K] fp32 skips the reshape and casts; a [1, T, K] input takes the general path. The
    same integers and scales reach the kernel either way, so the outputs are bit-equal (bias
    included), and bf16 input comes back bf16 with the fp32 result rounded once."""
    assert cg.load() is None
    g = torch.Generator().manual_seed(rows)
    layer = ReplicatedLinear(96, 40, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=g))
        layer.bias.copy_(torch.randn(40, generator=g))  # type: ignore[union-attr]
    layer.method = method
    method.process_after_load(layer)
    x = torch.randn(rows, 96, generator=g)
    fast = layer(x)
    general = layer(x[None])
    assert fast.shape == (rows, 40) and general.shape == (1, rows, 40)
    assert torch.equal(fast, general[0])
    # Against the kernels' float64 refs (x rounded as the kernel rounds it): the fast path is
    # the layer's product with its bias, not merely what the general path also returns.
    if layer.q4 is not None:
        ref = gemm_q4_ref(x, layer.q4, layer.bias, int8_x=q4_int8_activations())
    elif layer.q6 is not None:
        ref = gemm_q6_ref(x, layer.q6, layer.bias)
    else:
        assert layer.q8 is not None
        ref = gemm_q8_ref(x, layer.q8, layer.bias)
    assert (fast - ref).abs().max().item() <= 2e-6 * 96**0.5 * max(1.0, ref.abs().max().item())
    bf16 = layer(x.bfloat16())
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, layer(x.bfloat16().float()).bfloat16())
