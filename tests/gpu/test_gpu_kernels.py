"""Compiled Triton short-conv kernels against the torch reference at GPU model shapes.

Fixture-free on purpose: bench/gpu_check.sh can run these functions without pytest.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

PAD = -1
DIMS = (2048 + 16, 4096)  # + 16: a dim that is not a multiple of the kernels' block sizes
LENS = (129, 1, 17, 2, 64, 3)  # 129: one past a power of two


def _batch(dim: int, width: int, dtype: torch.dtype, lens: tuple[int, ...] = LENS):
    g = torch.Generator(device="cpu").manual_seed(dim + width)
    n = len(lens) + 1  # plus one pad row
    total = sum(lens) + 5
    proj = torch.randn(total, 3 * dim, generator=g)
    x = proj[:, dim : 2 * dim].t()  # [dim, T], token-major like ShortConv's in_proj chunk
    states = torch.randn(2 * n + 1, dim, width - 1, generator=g)
    w, b = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    all_lens = (*lens[:2], 5, *lens[2:])  # the pad row (5 tokens) sits third
    qsl = torch.tensor([0, *torch.tensor(all_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.randperm(2 * n, generator=g)[:n] + 1
    slots[2] = PAD
    init = torch.rand(n, generator=g) > 0.3
    cast = [t.cuda().to(dtype) for t in (x, states, w, b)]
    return (*cast, qsl.cuda(), slots.cuda(), init.cuda())


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def test_fn_matches_ref_at_model_shapes():
    from shortconv.kernels.conv1d_ref import causal_conv1d_fn_ref
    from shortconv.kernels.conv1d_triton import causal_conv1d_fn_triton

    for dim in DIMS:
        for width in (2, 3, 4, 5):
            for dtype in (torch.float32, torch.bfloat16):
                x, states, w, b, qsl, slots, init = _batch(dim, width, dtype)
                ref_states = states.clone()
                want = causal_conv1d_fn_ref(x, w, b, ref_states, qsl, slots, init, PAD)
                got = causal_conv1d_fn_triton(x, w, b, states, qsl, slots, init, PAD)
                torch.testing.assert_close(got, want, **_tol(dtype))
                assert torch.equal(states, ref_states), (dim, width, dtype)  # pure copies


def test_update_matches_ref_at_model_shapes():
    from shortconv.kernels.conv1d_ref import causal_conv1d_update_ref
    from shortconv.kernels.conv1d_triton import causal_conv1d_update_triton

    g = torch.Generator(device="cpu").manual_seed(3)
    for dim in DIMS:
        for batch in (1, 7, 129, 256):
            for dtype in (torch.float32, torch.bfloat16):
                proj = torch.randn(batch, 3 * dim, generator=g)
                x = proj[:, :dim].cuda().to(dtype)  # row stride 3*dim
                states = torch.randn(batch + 2, dim, 2, generator=g).cuda().to(dtype)
                w = torch.randn(dim, 3, generator=g).cuda().to(dtype)
                slots = (torch.randperm(batch + 1, generator=g)[:batch] + 1).cuda()
                slots[batch // 2] = PAD
                ref_states = states.clone()
                want = causal_conv1d_update_ref(x, ref_states, w, None, slots, PAD)
                got = causal_conv1d_update_triton(x, states, w, None, slots, PAD)
                torch.testing.assert_close(got, want, **_tol(dtype))
                assert torch.equal(states, ref_states), (dim, batch, dtype)


def test_update_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed over refreshed indices: equal to eager every time."""
    from shortconv.kernels.conv1d_triton import causal_conv1d_update_triton

    dim, batch = 2048 + 16, 32
    x = torch.randn(batch, dim, device="cuda")
    states = torch.randn(batch * 2 + 1, dim, 2, device="cuda")
    w = torch.randn(dim, 3, device="cuda")
    idx = torch.zeros(batch, dtype=torch.int64, device="cuda")  # scratch slot at capture
    out = torch.empty(batch, dim, device="cuda")
    causal_conv1d_update_triton(x, states, w, None, idx, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        causal_conv1d_update_triton(x, states, w, None, idx, out=out)
    for step in range(3):
        idx.copy_(torch.randperm(2 * batch, device="cuda")[:batch] + 1)
        x.copy_(torch.randn(batch, dim, device="cuda"))
        ref_states = states.clone()
        want = causal_conv1d_update_triton(x, ref_states, w, None, idx.clone())
        graph.replay()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert torch.equal(states, ref_states), step
