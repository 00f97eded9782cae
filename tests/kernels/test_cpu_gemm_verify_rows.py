"""q8 at a verify step's row counts (k + 1 = 2..9 positions of one request): each row of a
multi-row call is the same bits as that row called alone, on every tile set, so a request's
tokens do not depend on how many positions it was verified with; and the call is the float64
ref within fp32 rounding."""

from __future__ import annotations

import shutil

import pytest
import torch

from shortconv.kernels import cpu_gemm as cg

pytestmark = pytest.mark.skipif(
    not (cg.cpu_has_avx2_fma() and (shutil.which("c++") or shutil.which("g++"))),
    reason="needs an AVX2/FMA CPU and a C++ compiler",
)

# out x in: LFM2-350M's w2 in-width (36 groups of 4 blocks), its hidden width (8 groups), and
# 7 blocks (one group and a 3-block tail); out counts with a short last tile of weight rows.
SHAPES = [(13, 4608), (36, 1024), (9, 224)]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cg.load() is None


def _inputs(m: int, n: int, k: int) -> tuple[torch.Tensor, cg.Q8Weight]:
    g = torch.Generator().manual_seed(m * 101 + n + k)
    x = torch.randn(m, k, generator=g)
    # Rows and blocks of unlike size: a row read at another row's offset, or a scale on the
    # wrong lane, moves the result far past rounding.
    x *= torch.logspace(-2, 1, m).unsqueeze(1)
    x[:, 32:64] *= 1e-3
    return x, cg.quantize_q8(torch.randn(n, k, generator=g))


@pytest.mark.parametrize("m", [2, 3, 4, 5, 6, 7, 8, 9])
@pytest.mark.parametrize("n,k", SHAPES)
def test_each_row_of_a_verify_call_is_its_one_row_call_bitwise(
    m: int, n: int, k: int, isa: str
) -> None:
    x, qw = _inputs(m, n, k)
    rows = cg.gemm_q8(x, qw, None)
    for i in range(m):
        assert torch.equal(rows[i : i + 1], cg.gemm_q8(x[i : i + 1], qw, None)), f"row {i}"


@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_verify_call_equals_the_ref(m: int, n: int, k: int, isa: str) -> None:
    x, qw = _inputs(m, n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    y, ref = cg.gemm_q8(x, qw, bias), cg.gemm_q8_ref(x, qw, bias)
    # Per row: the rows' magnitudes differ 1000-fold, so one row's error bound is its own.
    for i in range(m):
        tol = 2e-6 * k**0.5 * max(1.0, ref[i].abs().max().item())
        assert (y[i] - ref[i]).abs().max().item() <= tol, f"row {i}"
