"""The q4 CPU linear (kernels/cpu_gemm_q4.inc) against its float64 ref, and the q4 format."""

from __future__ import annotations

import shutil

import pytest
import torch

from shortconv.kernels import cpu_gemm as cg
from shortconv.kernels.cpu_gemm_q4 import gemm_q4, gemm_q4_ref, q4_int8_activations, quantize_q4

pytestmark = pytest.mark.skipif(
    not (cg.cpu_has_avx2_fma() and (shutil.which("c++") or shutil.which("g++"))),
    reason="needs an AVX2/FMA CPU and a C++ compiler",
)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cg.load() is None  # where the CPU and a compiler are there, the build must work


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 17])
# k: 1, 32, 3, 5 and 7 blocks (the VNNI tile takes 4 a step, then a short last step).
@pytest.mark.parametrize("n,k", [(5, 32), (64, 1024), (129, 96), (33, 160), (12, 224)])
def test_q4_equals_ref(m: int, n: int, k: int, isa: str) -> None:
    g = torch.Generator().manual_seed(m * 11 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) + 0.3
    qw = quantize_q4(w)
    bias = torch.randn(n, generator=g) if n % 2 else None
    y, ref = gemm_q4(x, qw, bias), gemm_q4_ref(x, qw, bias, int8_x=isa == "avx512vnni")
    assert q4_int8_activations() == (isa == "avx512vnni")
    # fp32 sums in another order than float64's: error grows like sqrt(k).
    assert (y - ref).abs().max().item() <= 2e-6 * k**0.5 * max(1.0, ref.abs().max().item())
    # The ref is the dequantized weight's product up to x's rounding: ~3e-5 of a block's
    # largest magnitude in int16, ~4e-3 in int8.
    exact = x.double() @ qw.dequantize().double().T + (bias.double() if bias is not None else 0)
    per_k = 3e-2 if isa == "avx512vnni" else 1e-4
    assert (ref.double() - exact).abs().max().item() <= per_k * k**0.5


def test_quantize_q4_maps_each_block_between_its_min_and_max() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 96, generator=g) * torch.logspace(-3, 2, 96) + 0.5
    w[2, 32:64] = 0.25  # an all-equal block
    qw = quantize_q4(w)
    assert qw.q.dtype == torch.uint8 and qw.q.shape == (6, 48) and qw.min.shape == (6, 3)
    assert qw.scale.dtype == qw.min.dtype == torch.float16
    assert qw.nbytes == 6 * 48 + 2 * 2 * 6 * 3  # 5 bits a weight
    codes = qw.codes()
    assert codes.min() == 0 and codes.max() == 15
    assert qw.scale[2, 1] == 0 and (qw.dequantize()[2, 32:64] == 0.25).all()
    blocks = w.view(6, 3, 32)
    assert torch.equal(qw.min, blocks.amin(-1).half())  # each block's smallest value, in fp16
    # Half a code step, and what fp16 moved the pair by (2^-11 of the min and of 15 steps).
    err = (qw.dequantize() - w).abs().view(6, 3, 32)
    scale, low = qw.scale.float().unsqueeze(-1), qw.min.float().abs().unsqueeze(-1)
    assert (err <= scale / 2 * (1 + 1e-4) + 2**-11 * (low + 16 * scale) + 1e-6).all()
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q4(torch.randn(4, 40))


def test_a_row_alone_equals_the_row_in_a_batch(isa: str) -> None:
    g = torch.Generator().manual_seed(1)
    # 4099 weight rows: past one chunk of work, so two threads split it (and a short last tile).
    x, w = torch.randn(11, 256, generator=g), torch.randn(4099, 256, generator=g)
    qw = quantize_q4(w)
    full = gemm_q4(x, qw, None)
    for i in range(11):
        assert torch.equal(gemm_q4(x[i : i + 1], qw, None), full[i : i + 1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemm_q4(x, qw, None), full)
    finally:
        torch.set_num_threads(before)


def test_bad_shapes_are_refused() -> None:
    qw = quantize_q4(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="columns"):
        gemm_q4(torch.randn(2, 32), qw, None)
    with pytest.raises(RuntimeError, match="min must be"):
        torch.ops.shortconv_cpu.gemm_q4(torch.randn(2, 64), qw.q, qw.scale, qw.min[:, :1], None)
    with pytest.raises(RuntimeError, match="scale must be fp16"):  # the fp32 layout before
        torch.ops.shortconv_cpu.gemm_q4(torch.randn(2, 64), qw.q, qw.scale.float(), qw.min, None)
