"""The CPU GEMM tests' tile sets: `isa` runs a test once per set this CPU has."""

from __future__ import annotations

import pytest

from shortconv.kernels import cpu_gemm as cg


def _needs(isa: str) -> pytest.MarkDecorator:
    order = ["avx2", "avx512", "avx512vnni"]
    has = order.index(cg.cpu_isa()) >= order.index(isa)
    return pytest.mark.skipif(not has, reason=f"this CPU lacks {isa}")


@pytest.fixture(params=[pytest.param(i, marks=_needs(i)) for i in ("avx2", "avx512", "avx512vnni")])
def isa(request: pytest.FixtureRequest):  # noqa: ANN201 - a generator fixture
    """Runs the test on each tile set (fp32, q8, q4) this CPU has, then restores the load-time
    choice. Needs the kernels loaded (each module's autouse `kernels` fixture)."""
    before = cg.set_isa()
    assert cg.set_isa(request.param) == request.param
    yield request.param
    cg.set_isa(before)
