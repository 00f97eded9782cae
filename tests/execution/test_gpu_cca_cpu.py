"""tests/gpu/test_gpu_cca.py's random-stack check on CPU: the Triton CCA and conv kernels under
the interpreter give the torch reference's greedy tokens on a tiny ZAYA1 (no transformers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import test_gpu_cca as gc  # noqa: E402
from graph_helpers import zaya_skip_reason  # noqa: E402


def test_zaya1_random_stack_triton_equals_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if (reason := zaya_skip_reason()) is not None:
        pytest.skip(reason)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tokens = gc.random_stack_tokens("cpu", "triton", steps=4)
    assert tokens == gc.random_stack_tokens("cpu", "torch", steps=4)
    assert all(len(t) == 4 for t in tokens)
