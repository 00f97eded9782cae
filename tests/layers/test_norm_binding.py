"""RMSNorm's kernel choice, bound once at build: our fused CPU kernel for fp32 layers on CPU
where the engine's kernels are loaded and wanted (LinearPolicy.cpu_gemm), torch's otherwise."""

from __future__ import annotations

import pytest
import torch

from shortconv.configs.config import ModelConfig
from shortconv.execution.parallel import SINGLE
from shortconv.kernels.cpu_norm import rms_norm_ref
from shortconv.layers.linear_binding import LinearPolicy
from shortconv.layers.norm import RMSNorm
from shortconv.models.build import build_model
from shortconv.models.registry import model_class
from tests.cpu_kernels import NEEDS_CPU_KERNELS, cpu_kernels  # noqa: F401 - the fixture
from tests.layers.test_random_stack import TINY

pytestmark = [NEEDS_CPU_KERNELS, pytest.mark.usefixtures("cpu_kernels")]


def _norms(dtype: torch.dtype, policy: LinearPolicy) -> list[RMSNorm]:
    cfg = ModelConfig.from_hf_dict(TINY)
    model = build_model(model_class(cfg.arch), cfg, SINGLE, "cpu", dtype, policy)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 3 * 2 + 2 + 1  # operator + ffn per layer, q/k of one, the final
    return norms


def _uses_kernel(norm: RMSNorm) -> bool:
    return norm._forward == norm._kernel_forward


def test_an_fp32_cpu_model_binds_every_norm_to_the_kernel() -> None:
    norms = _norms(torch.float32, LinearPolicy(cpu_gemm=True))
    assert all(_uses_kernel(n) for n in norms)
    g = torch.Generator().manual_seed(0)
    for n in norms:
        d = n.weight.shape[0]
        n.weight.copy_(torch.rand(d, generator=g) + 0.5)
        x = torch.randn(5, d, generator=g)
        # The kernel's fp32 order is not the reference's: close (tests/kernels/test_cpu_norm.py
        # states the bound), where torch.rms_norm's unbound path is bit-equal.
        torch.testing.assert_close(n(x), rms_norm_ref(x, n.weight, n.eps), rtol=1e-5, atol=0)


def test_torch_paths_stay_without_the_kernels_or_in_other_dtypes() -> None:
    assert not any(_uses_kernel(n) for n in _norms(torch.float32, LinearPolicy()))
    bf16 = _norms(torch.bfloat16, LinearPolicy(cpu_gemm=True))
    assert not any(_uses_kernel(n) for n in bf16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(bf16[0](x), bf16[0].reference(x))
