"""For tests of our CPU kernel library (kernels/cpu_gemm.load): skip where it cannot build,
and a fixture that loads it (where the CPU and a compiler are there, a failed build is a
defect, not a skip)."""

from __future__ import annotations

import shutil

import pytest

from shortconv.kernels import cpu_gemm as cg

NEEDS_CPU_KERNELS = pytest.mark.skipif(
    not (cg.cpu_has_avx2_fma() and (shutil.which("c++") or shutil.which("g++"))),
    reason="needs an AVX2/FMA CPU and a C++ compiler",
)


@pytest.fixture(scope="module")
def cpu_kernels() -> None:
    assert cg.load() is None
