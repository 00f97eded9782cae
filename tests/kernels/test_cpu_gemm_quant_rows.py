"""The q8 and q4 tiles' batch invariance at every row count a decode or verify batch brings
(1..40): an x row's output is the same bits whether the row is called alone or anywhere inside
a batch of M = 2..40 rows, on every tile set, so a request's tokens do not depend on its batch.
The tiles group a batch's rows (q8 VNNI: up to 6, as evenly as M allows; the others 4 or 3 at a
time, then the rest), and each group size is its own compiled path: a path that sums a row's
blocks, scales or mins in another order than the one-row path moves a bit here."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
import torch

from shortconv.kernels import cpu_gemm as cg
from shortconv.kernels.cpu_gemm_q4 import gemm_q4, gemm_q4_ref, quantize_q4

pytestmark = pytest.mark.skipif(
    not (cg.cpu_has_avx2_fma() and (shutil.which("c++") or shutil.which("g++"))),
    reason="needs an AVX2/FMA CPU and a C++ compiler",
)

ROWS = 40  # every group size of every tile set, and 32-row batches in several splits
# out x in, in blocks of 32: 7 blocks (q8 VNNI: one quad and a 3-block tail; q4 VNNI: a short
# last quad; the pair tiles: an odd last block) with a short last tile of weight rows (13 =
# 4 + 4 + 4 + 1); LFM2's hidden width (32 blocks: two whole 16-block steps of q4's mins); and
# LFM2-350M's w2 width (144 blocks: a masked last step of the mins).
SHAPES = [(13, 224), (9, 1024), (5, 4608)]
Gemm = Callable[[torch.Tensor], torch.Tensor]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cg.load() is None


def _case(kind: str, n: int, k: int) -> tuple[torch.Tensor, Gemm, Gemm]:
    """x [ROWS, k], the kernel and its float64 ref for one weight of `kind`."""
    g = torch.Generator().manual_seed(n * 7 + k)
    # Rows and blocks of unlike size: a row read at another row's offset, or a scale or min on
    # the wrong lane, moves the result far past rounding, so the ref check sees it.
    x = torch.randn(ROWS, k, generator=g) * torch.logspace(-2, 1, ROWS).unsqueeze(1)
    x[:, 32:64] *= 1e-3
    w = torch.randn(n, k, generator=g) + 0.3  # off centre: q4's mins carry part of each sum
    if kind == "q8":
        q8 = cg.quantize_q8(w)
        return (
            x,
            lambda rows: cg.gemm_q8(rows, q8, None),
            lambda rows: cg.gemm_q8_ref(rows, q8, None),
        )
    q4 = quantize_q4(w)
    int8_x = cg.set_isa() == "avx512vnni"
    return (
        x,
        lambda rows: gemm_q4(rows, q4, None),
        lambda rows: gemm_q4_ref(rows, q4, None, int8_x=int8_x),
    )


@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_alone_is_its_row_in_any_batch_bitwise(kind: str, n: int, k: int, isa: str) -> None:
    x, gemm, _ = _case(kind, n, k)
    alone = torch.cat([gemm(x[i : i + 1]) for i in range(ROWS)])
    for m in range(2, ROWS + 1):
        for start in sorted({0, (ROWS - m) // 2, ROWS - m}):
            batch = gemm(x[start : start + m])
            same = (batch == alone[start : start + m]).all(dim=1)
            assert same.all(), f"M={m} at row {start}: rows {(~same).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_batch_equals_the_ref(kind: str, n: int, k: int, isa: str) -> None:
    x, gemm, ref = _case(kind, n, k)
    y, want = gemm(x), ref(x)
    # Per row: the rows' magnitudes differ 1000-fold, so each row's bound is its own.
    for i in range(ROWS):
        tol = 2e-6 * k**0.5 * max(1.0, want[i].abs().max().item())
        assert (y[i] - want[i]).abs().max().item() <= tol, f"row {i}"
