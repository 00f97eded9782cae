"""The CPU GEMM tests' tile sets: `isa` runs a test once per set this CPU has."""

from __future__ import annotations

import pytest

from shortconv.kernels import cpu_gemm as cg

NO_AVX512 = pytest.mark.skipif(not cg.cpu_has_avx512(), reason="no AVX-512F and BW")


@pytest.fixture(params=["avx2", pytest.param("avx512", marks=NO_AVX512)])
def isa(request: pytest.FixtureRequest):  # noqa: ANN201 - a generator fixture
    """Runs the test on each tile set (fp32, q8, q4) this CPU has, then restores the load-time
    choice. Needs the kernels loaded (each module's autouse `kernels` fixture)."""
    before = cg.set_isa()
    assert cg.set_isa(request.param) == request.param
    yield request.param
    cg.set_isa(before)
