"""The CPU int8 linear (fbgemm) against its float64 oracle, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from shortconv.kernels.int8_linear_cpu import (
    int8_linear,
    int8_linear_ref,
    pack_int8,
    quantize_int8,
)


def _weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[3] *= 40  # one loud output row: per-row scales keep the others fine
    return w


@pytest.mark.parametrize("shape", [(1, 64), (7, 200), (33, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_its_ref(shape: tuple[int, int], bias: bool) -> None:
    rows, in_f = shape
    w = _weight(96, in_f, seed=rows)
    q, scale = quantize_int8(w)
    packed = pack_int8(q, scale)
    assert torch.equal(packed.unpacked(), q)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, in_f, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    b = torch.randn(96, generator=g) if bias else None
    got, want = int8_linear(x, packed, b), int8_linear_ref(x, q, scale, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # Against the dequantized weight in fp32, only the activations' ~14 bits are off.
    dequant = torch.nn.functional.linear(x, q.float() * scale[:, None], b)
    assert (got - dequant).norm() / dequant.norm() < 1e-3
    exact = torch.nn.functional.linear(x, w, b)
    assert (got - exact).norm() / exact.norm() < 3e-2  # int8 weights, a scale per row


def test_a_row_gets_the_same_bits_alone_or_in_any_batch() -> None:
    w = _weight(128, 256, seed=1)
    packed = pack_int8(*quantize_int8(w))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([int8_linear(x[i : i + 1], packed) for i in range(5)])
    loud = torch.cat([x, torch.randn(11, 256) * 1e3, torch.zeros(1, 256)])
    assert torch.equal(int8_linear(loud, packed)[:5], alone)
    assert torch.equal(int8_linear(x.flip(0), packed).flip(0), alone)


def test_zero_rows_give_the_bias_and_dtype_and_shape_follow_x() -> None:
    w = _weight(32, 64, seed=2)
    packed = pack_int8(*quantize_int8(w))
    b = torch.randn(32)
    out = int8_linear(torch.zeros(2, 3, 64), packed, b)
    assert out.shape == (2, 3, 32) and torch.equal(out, b.expand(2, 3, 32))
    assert int8_linear(torch.randn(4, 64).bfloat16(), packed).dtype == torch.bfloat16


def test_scales_are_the_rows_largest_magnitude_over_127() -> None:
    w = _weight(16, 64, seed=3)
    q, scale = quantize_int8(w)
    torch.testing.assert_close(scale, w.abs().amax(1) / 127)
    assert q.dtype == torch.int8 and q.abs().amax(1).eq(127).all()
