"""The q6 CPU linear (kernels/cpu_gemm_q6.inc) against its float64 ref on every tile set, its
batch invariance at 1..70 rows, and the q6 format: packing and the quantizer's error."""

from __future__ import annotations

import shutil

import pytest
import torch

from shortconv.kernels import cpu_gemm as cg
from shortconv.kernels.cpu_gemm_q6 import (
    Q6Weight,
    gemm_q6,
    gemm_q6_ref,
    pack_codes,
    quantize_q6,
    unpack_codes,
)

pytestmark = pytest.mark.skipif(
    not (cg.cpu_has_avx2_fma() and (shutil.which("c++") or shutil.which("g++"))),
    reason="needs an AVX2/FMA CPU and a C++ compiler",
)

ROWS = 70
# out x in: 7 blocks (a VNNI quad and a 3-block tail, an odd pair-tile block) with a short last
# tile of weight rows (13 = 3 x 4 + 1); one block; LFM2's hidden width; a w2-like width.
SHAPES = [(13, 224), (6, 32), (9, 1024), (5, 4608)]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cg.load() is None


def _case(n: int, k: int) -> tuple[torch.Tensor, Q6Weight]:
    g = torch.Generator().manual_seed(n * 7 + k)
    # Rows of unlike size and a quiet block: a row or scale read from the wrong place moves the
    # result far past rounding.
    x = torch.randn(ROWS, k, generator=g) * torch.logspace(-2, 1, ROWS).unsqueeze(1)
    x[:, :32] *= 1e-3
    # Blocks of unlike size too, and every code used: a neighbour's scale, or a high part
    # shifted onto the wrong weight, changes the products by a large factor.
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 1, k // 32).repeat_interleave(32)
    return x, quantize_q6(w)


def _bound(want: torch.Tensor, k: int) -> float:
    return 2e-6 * k**0.5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("n,k", SHAPES)
def test_q6_equals_ref(n: int, k: int, isa: str) -> None:
    x, qw = _case(n, k)
    bias = torch.randn(n) if n % 2 else None
    y, want = gemm_q6(x, qw, bias), gemm_q6_ref(x, qw, bias)
    for i in range(ROWS):  # each row's own bound: their magnitudes differ 1000-fold
        assert (y[i] - want[i]).abs().max().item() <= _bound(want[i], k), f"row {i}"
    # The ref is the dequantized weight's product up to x's int16 rounding: each value within
    # half of 1/32767 of its block's largest magnitude, so a row within 1.6e-5 max|x| sum|w|.
    deq = qw.dequantize().double()
    exact = x.double() @ deq.T + (bias.double() if bias is not None else 0)
    tol = 1.6e-5 * x.abs().amax(1, keepdim=True).double() * deq.abs().sum(1).max()
    assert ((want.double() - exact).abs() <= tol).all()


@pytest.mark.parametrize("n,k", SHAPES)
def test_q6_is_q8_on_the_same_integers_bitwise(n: int, k: int, isa: str) -> None:
    x, qw = _case(n, k)
    assert torch.equal(gemm_q6(x, qw, None), cg.gemm_q8(x, qw.as_q8(), None))


@pytest.mark.parametrize("n,k", [(13, 224), (5, 4608)])
def test_a_row_alone_is_its_row_in_any_batch_bitwise(n: int, k: int, isa: str) -> None:
    x, qw = _case(n, k)
    alone = torch.cat([gemm_q6(x[i : i + 1], qw, None) for i in range(ROWS)])
    for m in range(2, ROWS + 1):
        for start in sorted({0, (ROWS - m) // 2, ROWS - m}):
            batch = gemm_q6(x[start : start + m], qw, None)
            same = (batch == alone[start : start + m]).all(dim=1)
            assert same.all(), f"M={m} at row {start}: rows {(~same).nonzero().flatten().tolist()}"


def test_pack_unpack_round_trip_and_layout() -> None:
    # 6 rows of 5 blocks (a group of 4 and a tail block), every code in each row, shuffled.
    g = torch.Generator().manual_seed(1)
    codes = torch.stack(
        [torch.arange(-32, 32).repeat(3)[torch.randperm(192, generator=g)][:160] for _ in range(6)]
    )
    codes = codes.view(6, 5, 32)
    packed = pack_codes(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 5 * 24)
    assert torch.equal(unpack_codes(packed), codes)
    # The group: word w (bytes 2w, 2w + 1) and byte 64 + w hold block w // 8's weights
    # 8t + w % 8 for registers t = 0..3, as s = code & 63: s0 at bits 10-15, s1 at 4-9, s2's low
    # 4 bits at 0-3; s3 at bits 2-7 of the byte, s2's high 2 bits at 0-1.
    row = packed[2].tolist()
    for w in (0, 13, 19, 31):
        s = [int(codes[2, w // 8, 8 * t + w % 8]) & 63 for t in range(4)]
        assert row[2 * w] | (row[2 * w + 1] << 8) == (s[0] << 10) | (s[1] << 4) | (s[2] & 15)
        assert row[64 + w] == (s[3] << 2) | (s[2] >> 4)
    # The tail block at byte 96: byte j: weight j's low nibble low, weight j + 16's high; byte
    # 16 + i: the high parts of weights i, i + 8, i + 16, i + 24 at bits 0, 2, 4, 6 (of code + 32).
    u = [int(c) + 32 for c in codes[2, 4]]
    assert row[96 + 3] == (u[3] & 15) | ((u[19] & 15) << 4)
    assert row[96 + 16 + 5] == sum((u[5 + 8 * t] >> 4) << 2 * t for t in range(4))


def test_quantize_q6_error_and_format() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-3, 2, 256)
    w[3, 32:64] = 0.0  # an all-zero block
    qw = quantize_q6(w)
    assert qw.q.shape == (64, 8 * 24) and qw.scale.shape == (64, 8)
    assert qw.scale.dtype == torch.float16 and qw.nbytes * 8 == 64 * 256 * 6.5
    codes = qw.codes()
    assert codes.min() >= -32 and codes.max() <= 31
    assert (qw.dequantize()[3, 32:64] == 0).all() and qw.scale[3, 1] == 0
    # Per weight, within a step of its block: half a step inside the code range, and the
    # least-squares fit may clip the block's far side a little past it (0.89 of a step at most
    # here); the sum of squares at most 0.95x that of max|w| / 31 with nearest codes.
    blocks, deq = w.view(64, 8, 32), qw.dequantize().view(64, 8, 32)
    step = qw.scale.float().abs().unsqueeze(-1)  # negative where the peak is positive
    assert ((deq - blocks).abs() <= step).all()
    plain = (blocks.abs().amax(-1, keepdim=True) / 31).half().float()
    safe = torch.where(plain > 0, plain, torch.ones_like(plain))
    plain_err = ((torch.round(blocks / safe).clamp(-32, 31) * plain - blocks) ** 2).sum()
    fitted_err = ((deq - blocks) ** 2).sum()
    assert fitted_err <= 0.95 * plain_err, (fitted_err, plain_err)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q6(torch.randn(4, 40))
    qw = quantize_q6(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="columns"):
        gemm_q6(torch.randn(2, 32), qw, None)
    with pytest.raises(RuntimeError, match="whole blocks"):
        torch.ops.shortconv_cpu.gemm_q6(torch.randn(2, 64), qw.q[:, :40], qw.scale, None)
    with pytest.raises(RuntimeError, match="fp16"):
        torch.ops.shortconv_cpu.gemm_q6(torch.randn(2, 64), qw.q, qw.scale.float(), None)
