"""Routed experts: the padded batched path, the per-expert loop and the graph-safe dense path
compute the same mixture (skip routes and zero weights included)."""

from __future__ import annotations

import pytest
import torch

from shortconv.execution.parallel import ParallelContext
from shortconv.layers import experts as experts_mod
from shortconv.layers.experts import FusedExperts


def _moe(e: int, h: int, i: int) -> FusedExperts:
    moe = FusedExperts(e, h, i, ParallelContext())
    g = torch.Generator().manual_seed(e * 100 + h)
    with torch.no_grad():
        moe.gate_up_proj.copy_(torch.randn(moe.gate_up_proj.shape, generator=g) * h**-0.5)
        moe.down_proj.copy_(torch.randn(moe.down_proj.shape, generator=g) * i**-0.5)
    return moe


def _routes(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e + 1, generator=g)[:k] for _ in range(t)])  # e = skip
    w = torch.rand(t, k, generator=g)
    if t > 1:
        w[0, 0] = 0.0  # a zero mixing weight contributes nothing
    return ids, w


def _by_path(moe: FusedExperts, x, ids, w, path: str, monkeypatch: pytest.MonkeyPatch):
    padded = path == "padded"
    monkeypatch.setattr(experts_mod, "PADDED_MAX_ROWS", 1 << 30 if padded else 0)
    monkeypatch.setattr(experts_mod, "PADDED_MIN_ACTIVE", 0.0)
    moe.capture_safe = path == "dense"
    with torch.inference_mode():
        return moe(x, ids, w)


@pytest.mark.parametrize(("t", "k"), [(1, 1), (9, 1), (32, 1), (9, 2), (40, 2)])
def test_padded_loop_and_dense_paths_agree(t: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    e, h, i = 6, 32, 24
    moe = _moe(e, h, i)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t))
    ids, w = _routes(t, e, k, seed=t + k)
    loop = _by_path(moe, x, ids, w, "loop", monkeypatch)
    padded = _by_path(moe, x, ids, w, "padded", monkeypatch)
    dense = _by_path(moe, x, ids, w, "dense", monkeypatch)
    assert loop.abs().sum() > 0
    torch.testing.assert_close(padded, loop, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dense, loop, rtol=1e-5, atol=1e-6)


def test_the_padded_path_is_taken_only_for_small_groups_over_most_experts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Groups above PADDED_MAX_ROWS (compute-bound GEMMs) and batches that use few experts (the
    padded matmuls would read every expert's weights) go through the loop."""
    moe = _moe(6, 16, 8)
    calls: list[int] = []
    real = FusedExperts._padded
    monkeypatch.setattr(FusedExperts, "_padded", lambda s, *a: calls.append(a[-1]) or real(s, *a))
    big = 6 * experts_mod.PADDED_MAX_ROWS + 6
    with torch.inference_mode():
        for t, used in ((12, 6), (big, 6), (12, 3), (12, 4)):
            ids = (torch.arange(t) % used)[:, None]  # an even spread over `used` experts
            moe(torch.randn(t, 16), ids, torch.ones(t, 1))
    assert calls == [2, 3]  # (12 over 6 experts: 2 rows each), (12 over 4 of 6: 3 rows each)


def test_all_routes_skipped_gives_zeros() -> None:
    moe = _moe(3, 16, 8)
    with torch.inference_mode():
        out = moe(torch.randn(5, 16), torch.full((5, 1), 3), torch.ones(5, 1))
    assert torch.equal(out, torch.zeros(5, 16))
