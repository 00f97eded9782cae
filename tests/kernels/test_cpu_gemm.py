"""The AVX2 and AVX-512 small-batch GEMMs (kernels/cpu_gemm.cpp) against their float64 refs."""

from __future__ import annotations

import shutil

import pytest
import torch

from shortconv.kernels import cpu_gemm as cg

pytestmark = pytest.mark.skipif(
    not (cg.cpu_has_avx2_fma() and (shutil.which("c++") or shutil.which("g++"))),
    reason="needs an AVX2/FMA CPU and a C++ compiler",
)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    # Where the CPU and a compiler are there, the build must work: a failure is a defect, not
    # a skip.
    assert cg.load() is None
    assert cg.loaded()


def test_the_load_time_choice_is_the_widest_the_cpu_has() -> None:
    assert cg.set_isa() == cg.cpu_isa()
    with pytest.raises(RuntimeError, match="isa must be"):
        cg.set_isa("sse")


def _close(y: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    # fp32 sums of k products in a different order than float64's: error grows like sqrt(k).
    tol = 2e-6 * (k**0.5) * max(1.0, ref.abs().max().item())
    assert (y - ref).abs().max().item() <= tol


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17])
@pytest.mark.parametrize("n,k", [(4, 8), (13, 100), (64, 1024), (130, 37)])
def test_f32_equals_ref(m: int, n: int, k: int, isa: str) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if n % 2 else None
    y = cg.gemm_f32(x, w, bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    _close(y, cg.gemm_f32_ref(x, w, bias), k)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("n,k", [(5, 32), (64, 1024), (129, 96)])
def test_q8_equals_ref(m: int, n: int, k: int, isa: str) -> None:
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    qw = cg.quantize_q8(w)
    bias = torch.randn(n, generator=g)
    _close(cg.gemm_q8(x, qw, bias), cg.gemm_q8_ref(x, qw, bias), k)


@pytest.mark.parametrize("m", [6, 9, 13, 23])
@pytest.mark.parametrize("n,k", [(9, 160), (36, 224), (8, 4608)])
def test_q8_block_groups_tails_and_row_splits_equal_ref(m: int, n: int, k: int, isa: str) -> None:
    """The VNNI tile scales 4 blocks a register and runs the 1-3 blocks past the last group
    alone, in tiles of up to 6 x rows split evenly (9 = 5 + 4, 23 = 6 + 6 + 6 + 5): groups with
    tails (5 and 7 blocks), several tiles a row, against the ref on every tile set."""
    g = torch.Generator().manual_seed(m * 31 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    x[:, 32:64] *= 1e-3  # blocks of unlike size: a scale on the wrong lane shows
    qw = cg.quantize_q8(w)
    _close(cg.gemm_q8(x, qw, None), cg.gemm_q8_ref(x, qw, None), k)
    for i in (0, m - 1):  # a row alone: the same bits as in its tile of the batch
        assert torch.equal(cg.gemm_q8(x[i : i + 1], qw, None), cg.gemm_q8(x, qw, None)[i : i + 1])


def test_quantize_q8_rounds_each_block_to_its_own_scale() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 96, generator=g) * torch.logspace(-3, 2, 96)  # blocks of very unlike size
    w[2, 32:64] = 0.0
    qw = cg.quantize_q8(w)
    assert qw.q.dtype == torch.int8 and qw.scale.shape == (6, 3)
    assert qw.q.abs().max() <= 127 and (qw.q[2, 32:64] == 0).all() and qw.scale[2, 1] == 0
    err = (qw.dequantize() - w).abs().view(6, 3, 32)
    assert (err <= qw.scale.unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    # A row scale would round the small blocks to nothing; block scales keep them.
    assert (qw.dequantize()[:, :32] != 0).any()
    with pytest.raises(ValueError, match="divisible by 32"):
        cg.quantize_q8(torch.randn(4, 40))


@pytest.mark.parametrize("kind", ["f32", "q8"])
def test_a_row_alone_equals_the_row_in_a_batch(kind: str, isa: str) -> None:
    """Each output is one row's own sums in a fixed order: batch and tile position do not
    change a bit of it (so a request's tokens do not depend on its batch)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(11, 256, generator=g), torch.randn(70, 256, generator=g)
    qw = cg.quantize_q8(w)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return cg.gemm_f32(rows, w, None) if kind == "f32" else cg.gemm_q8(rows, qw, None)

    full = run(x)
    for i in range(11):
        assert torch.equal(run(x[i : i + 1]), full[i : i + 1])
    assert torch.equal(run(x[3:8]), full[3:8])


@pytest.mark.parametrize("kind", ["f32", "q8"])
def test_thread_count_does_not_change_the_result(kind: str, isa: str) -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 512, generator=g), torch.randn(4099, 512, generator=g)
    qw = cg.quantize_q8(w)

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return cg.gemm_f32(x, w, None) if kind == "f32" else cg.gemm_q8(x, qw, None)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x, w)
        torch.set_num_threads(2)
        two = run(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_strided_input_and_bad_shapes() -> None:
    w = torch.randn(8, 64)
    x = torch.randn(64, 4).T  # non-contiguous
    _close(cg.gemm_f32(x, w, None), cg.gemm_f32_ref(x, w, None), 64)
    with pytest.raises(RuntimeError, match="columns"):
        cg.gemm_f32(torch.randn(2, 63), w, None)
    with pytest.raises(RuntimeError, match="fp32"):
        cg.gemm_f32(torch.randn(2, 64).double(), w, None)
    qw = cg.quantize_q8(w)
    with pytest.raises(RuntimeError, match="scale must be"):
        torch.ops.shortconv_cpu.gemm_q8(torch.randn(2, 64), qw.q, qw.scale[:, :1], None)


def test_a_new_source_builds_a_new_library(tmp_path, monkeypatch) -> None:
    """The cache key follows the source and torch: an edited kernel is never served stale."""
    monkeypatch.setenv("SHORTCONV_CACHE", str(tmp_path))
    first = cg.library_path()
    assert first.parent == tmp_path / "kernels"
    monkeypatch.setattr(cg.torch, "__version__", "0.0.0-other")
    assert cg.library_path() != first


def test_the_environment_pins_the_avx2_tiles() -> None:
    """SHORTCONV_CPU_GEMM_ISA=avx2 at load keeps the AVX2 tiles on an AVX-512 CPU (a fresh
    process: the choice is made once, when the library loads)."""
    import os
    import subprocess
    import sys

    code = "from shortconv.kernels import cpu_gemm as c\nc.load()\nprint(c.set_isa())"
    env = {**os.environ, "SHORTCONV_CPU_GEMM_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "avx2"
