"""The fused fp32 RMSNorm (kernels/cpu_norm.inc) against its float64 ref, and its batch
invariance: a row alone is the same bits as that row in a batch."""

from __future__ import annotations

import pytest
import torch

from shortconv.kernels.cpu_norm import rms_norm_cpu, rms_norm_ref
from tests.cpu_kernels import NEEDS_CPU_KERNELS, cpu_kernels  # noqa: F401 - the fixture

pytestmark = [NEEDS_CPU_KERNELS, pytest.mark.usefixtures("cpu_kernels")]

EPS = 1e-5


def _inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of three magnitudes: ordinary (mean square ~9, eps a rounding error), tiny (mean
    square ~1e-6 << eps: eps sets the scale) and all-zero (the output must be 0, not NaN)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    rows = x.view(-1, shape[-1])
    rows[1::3] *= 1e-3
    rows[2::3] = 0
    return x, torch.randn(shape[-1], generator=g)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    # Each output is x * r * w, so its error is relative. Worst case in units of 2^-24: the
    # fp32 sum of squares (a lane adds D / 32 terms on AVX2, D / 64 on AVX-512, then a 5-6 level
    # reduce: all terms positive, so that bounds its relative error) halves through the square
    # root, and the mean, + eps, sqrt, 1 / and the two products add one each. 2^-23 * (D / 32
    # + 16) covers it with room; dropping eps or mixing rows is off by far more.
    d = ref.shape[-1]
    tol = 2.0**-23 * (d / 32 + 16) * ref.abs()
    assert torch.isfinite(y).all()
    assert ((y - ref).abs() <= tol).all(), ((y - ref).abs() / ref.abs().clamp_min(1e-30)).max()


@pytest.mark.parametrize(
    "shape",
    [(1, 1024), (3, 1024), (33, 1024), (1, 16, 64), (5, 8, 64), (4, 7), (6, 40), (3, 1040)],
)
def test_rms_norm_equals_ref(shape: tuple[int, ...], isa: str) -> None:
    x, w = _inputs(shape, sum(shape))
    y = rms_norm_cpu(x, w, EPS)
    assert y.shape == x.shape and y.dtype == torch.float32
    _close(y, rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("shape", [(2, 1024), (5, 1024), (17, 1024), (100, 1024), (33, 6, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_alone_is_the_same_bits_as_in_a_batch(
    shape: tuple[int, ...], threads: int, isa: str
) -> None:
    # 100 x 1024 is past the one-thread limit (64K floats): with 2 threads its rows split.
    x, w = _inputs(shape, 7 * sum(shape))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = rms_norm_cpu(x, w, EPS)
        for i in range(shape[0]):
            # A copy: the row alone in its own memory, as a request alone has it.
            alone = x[i : i + 1].clone()
            assert torch.equal(rms_norm_cpu(alone, w, EPS), batch[i : i + 1])
    finally:
        torch.set_num_threads(before)


def test_a_non_contiguous_x_reads_its_own_elements(isa: str) -> None:
    # A q/k head view of a wider projection, and a transposed one: strides other than [.., 1].
    x, w = _inputs((6, 3, 64), 11)
    wide = torch.randn(6, 5, 64)
    wide[:, 1:4] = x
    for view in (wide[:, 1:4], x.transpose(0, 1).contiguous().transpose(0, 1)):
        assert not view.is_contiguous()
        y = rms_norm_cpu(view, w, EPS)
        assert torch.equal(y, rms_norm_cpu(x, w, EPS))
        _close(y, rms_norm_ref(x, w, EPS))


def test_bad_inputs_are_refused_clearly() -> None:
    x, w = torch.randn(2, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match="last dimension is 64, the weight's 32"):
        rms_norm_cpu(x, w[:32], EPS)
    with pytest.raises(RuntimeError, match="x must be an fp32 CPU tensor"):
        rms_norm_cpu(x.bfloat16(), w, EPS)
    with pytest.raises(RuntimeError, match="weight must be a 1-D fp32 CPU tensor"):
        rms_norm_cpu(x, w.view(2, 32), EPS)
    assert rms_norm_cpu(torch.empty(0, 64), w, EPS).shape == (0, 64)
