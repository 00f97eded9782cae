"""The fp32 tile's batch invariance at every row count it serves (1..64, and past it): an x
row's output is the same bits whether the row is called alone or anywhere inside a batch of
M = 2..70 rows, on every tile set, so a request's tokens do not depend on its batch, and a
resumed session's short suffix rounds as the rows of a whole prefill do. The AVX-512 tile
groups a batch's rows 6 at a time, as evenly as M allows, and runs K in blocks with its
accumulators stored between them; none of that may move a bit."""

from __future__ import annotations

import shutil

import pytest
import torch

from shortconv.kernels import cpu_gemm as cg

pytestmark = pytest.mark.skipif(
    not (cg.cpu_has_avx2_fma() and (shutil.which("c++") or shutil.which("g++"))),
    reason="needs an AVX2/FMA CPU and a C++ compiler",
)

ROWS = 70  # past the AVX-512 tile's 64-row pass, so a batch can also take two passes
# out x in: a short last tile of weight rows (13 = 4 + 4 + 4 + 1) with K one block with a
# masked tail (100), LFM2's hidden width (one block), three blocks with a masked tail, and
# LFM2-350M's w2 width (4.5 blocks).
SHAPES = [(13, 100), (9, 1024), (13, 2103), (5, 4608)]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cg.load() is None


def _inputs(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 7 + k)
    # Rows of unlike size: a row read at another row's offset moves the result far past
    # rounding, so the ref check below sees it.
    x = torch.randn(ROWS, k, generator=g) * torch.logspace(-2, 1, ROWS).unsqueeze(1)
    return x, torch.randn(n, k, generator=g)


@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_alone_is_its_row_in_any_batch_bitwise(n: int, k: int, isa: str) -> None:
    x, w = _inputs(n, k)
    alone = torch.cat([cg.gemm_f32(x[i : i + 1], w, None) for i in range(ROWS)])
    for m in range(2, ROWS + 1):
        for start in sorted({0, (ROWS - m) // 2, ROWS - m}):
            batch = cg.gemm_f32(x[start : start + m], w, None)
            same = (batch == alone[start : start + m]).all(dim=1)
            assert same.all(), f"M={m} at row {start}: rows {(~same).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("m", [1, 6, 7, 13, 32, 64, ROWS])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_batch_equals_the_ref(m: int, n: int, k: int, isa: str) -> None:
    x, w = _inputs(n, k)
    x = x[ROWS - m :]
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m))
    y, ref = cg.gemm_f32(x, w, bias), cg.gemm_f32_ref(x, w, bias)
    # Per row: the rows' magnitudes differ 1000-fold, so each row's bound is its own.
    for i in range(m):
        tol = 2e-6 * k**0.5 * max(1.0, ref[i].abs().max().item())
        assert (y[i] - ref[i]).abs().max().item() <= tol, f"row {i}"
