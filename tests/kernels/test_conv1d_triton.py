"""Triton short-conv kernels against the torch reference.

On CPU the kernels run under Triton's interpreter. triton 3.6 reads TRITON_INTERPRET when a
function is passed through `triton.jit` (not when triton is imported), and conv1d_triton jits
lazily once per mode, so a per-test setenv is enough and does not leak into other modules.
With a GPU the same checks also run compiled (marked `gpu`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shortconv.kernels import causal_conv1d_fn, causal_conv1d_update  # noqa: E402
from shortconv.kernels.conv1d_ref import (  # noqa: E402
    causal_conv1d_fn_ref,
    causal_conv1d_update_ref,
)
from shortconv.kernels.conv1d_triton import (  # noqa: E402
    MAX_CONV_WIDTH,
    causal_conv1d_fn_triton,
    causal_conv1d_update_triton,
)

N_SLOTS = 10
PAD = -1
# Every short-conv width the kernels take (2..MAX_CONV_WIDTH): LFM2's 3, LFM3's 7 and around them.
WIDTHS = list(range(2, MAX_CONV_WIDTH + 1))
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


def make_batch(dim: int, width: int, idx_dtype: torch.dtype, dtype: torch.dtype, device: str):
    """Lens 1/2/5/33 plus a pad row; permuted slots; mixed has_initial_state; strided x."""
    g = torch.Generator().manual_seed(dim * 10 + width)
    lens = [2, 5, 3, 1, 33]
    total = sum(lens)
    proj = torch.randn(total, 3 * dim, generator=g) + 0.5
    x = proj[:, :dim].t()  # [dim, T] view with token stride 3*dim
    weight = torch.randn(dim, width, generator=g)
    bias = torch.randn(dim, generator=g)
    states = torch.randn(N_SLOTS, dim, width - 1, generator=g) + 0.5
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([6, 3, PAD, 8, 1], dtype=idx_dtype)
    has_init = torch.tensor([True, False, True, True, False])
    x, weight, bias, states = (t.to(dtype) for t in (x, weight, bias, states))
    return [t.to(device) for t in (x, weight, bias, states, qsl, slots, has_init)]


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dim", [7, 64])
def test_fn_matches_ref(device: str, dim: int, width: int, idx_dtype: torch.dtype) -> None:
    x, weight, bias, states, qsl, slots, has_init = make_batch(
        dim, width, idx_dtype, torch.float32, device
    )
    ref_states, before = states.clone(), states.clone()
    want = causal_conv1d_fn_ref(x, weight, bias, ref_states, qsl, slots, has_init, PAD)
    out = torch.full(x.shape, float("nan"), device=device)
    got = causal_conv1d_fn_triton(x, weight, bias, states, qsl, slots, has_init, PAD, out=out)
    assert got is out and not out.isnan().any()  # every live token overwritten
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[:, 7:10]) == 0  # pad row (tokens 7:10) zeroed
    assert torch.equal(states, ref_states)  # state is a pure copy: bit-identical
    for slot in (0, 2, 4, 5, 7, 9):  # not owned by any live row, incl. the pad clamp targets
        assert torch.equal(states[slot], before[slot]), slot
    # Without out=, a token-major x gives a token-major out.
    fresh = causal_conv1d_fn_triton(x, weight, None, before.clone(), qsl, slots, has_init, PAD)
    want = causal_conv1d_fn_ref(x, weight, None, before.clone(), qsl, slots, has_init, PAD)
    assert fresh.stride(0) == 1
    torch.testing.assert_close(fresh, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("width", WIDTHS)
def test_update_matches_ref(device: str, width: int, idx_dtype: torch.dtype) -> None:
    dim = 64
    _, weight, bias, states, *_ = make_batch(dim, width, idx_dtype, torch.float32, device)
    ref_states, before = states.clone(), states.clone()
    idx = torch.tensor([4, PAD, 0, 9], dtype=idx_dtype, device=device)
    for step in range(3):
        xd = (torch.randn(4, 2 * dim) + 0.5).to(device)[:, dim:]  # row stride 2*dim
        want = causal_conv1d_update_ref(xd, ref_states, weight, bias, idx, PAD)
        out = torch.full((4, dim), float("nan"), device=device)
        got = causal_conv1d_update_triton(xd, states, weight, bias, idx, PAD, out=out)
        assert got is out and not out.isnan().any()
        assert torch.count_nonzero(out[1]) == 0
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(states, ref_states), step
    for slot in (1, 2, 3, 5, 6, 7, 8):
        assert torch.equal(states[slot], before[slot]), slot


@pytest.mark.parametrize("width", [2, 5, 7, 8])
def test_prefill_then_decode_equals_full_prefill(device: str, width: int) -> None:
    dim, steps = 7, 3
    x, weight, bias, states, qsl, slots, has_init = make_batch(
        dim, width, torch.int64, torch.float32, device
    )
    live = slots != PAD
    full_states = states.clone()
    full = causal_conv1d_fn_triton(x, weight, bias, full_states, qsl, slots, has_init, PAD)
    # Prefill everything except the last `steps` tokens of the 33-token sequence, then decode
    # those one at a time through its slot.
    last = slots.numel() - 1
    start, end = int(qsl[last]), int(qsl[last + 1])
    pre_qsl = qsl.clone()
    pre_qsl[-1] = end - steps
    keep = torch.ones(x.shape[1], dtype=torch.bool, device=device)
    keep[end - steps : end] = False
    pre_states = states.clone()
    causal_conv1d_fn_triton(x[:, keep], weight, bias, pre_states, pre_qsl, slots, has_init, PAD)
    idx = slots[last : last + 1]
    for s in range(steps):
        tok = end - steps + s
        got = causal_conv1d_update_triton(x[:, tok][None], pre_states, weight, bias, idx, PAD)
        torch.testing.assert_close(got[0], full[:, tok], rtol=1e-5, atol=1e-5)
    assert start < end - steps and bool(live[last])
    torch.testing.assert_close(pre_states, full_states)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_accumulate_in_fp32(device: str, dtype: torch.dtype) -> None:
    x, weight, bias, states, qsl, slots, has_init = make_batch(64, 4, torch.int32, dtype, device)
    ref_states = states.clone()
    want = causal_conv1d_fn_ref(x, weight, bias, ref_states, qsl, slots, has_init, PAD)
    got = causal_conv1d_fn_triton(x, weight, bias, states, qsl, slots, has_init, PAD)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(states, ref_states)
    xd = x[:, :3].t()
    idx = slots[:3]
    want = causal_conv1d_update_ref(xd, ref_states, weight, bias, idx, PAD)
    got = causal_conv1d_update_triton(xd, states, weight, bias, idx, PAD)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(states, ref_states)


def test_dispatch_forced_triton(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHORTCONV_KERNELS", "triton")
    x, weight, bias, states, qsl, slots, has_init = make_batch(
        7, 3, torch.int64, torch.float32, device
    )
    s1, s2 = states.clone(), states.clone()
    got = causal_conv1d_fn(x, weight, bias, s1, qsl, slots, has_init)
    want = causal_conv1d_fn_triton(x, weight, bias, s2, qsl, slots, has_init)
    assert torch.equal(got, want) and torch.equal(s1, s2)
    xd = x[:, :2].t()
    got = causal_conv1d_update(xd, s1, weight, bias, slots[:2])
    assert torch.equal(got, causal_conv1d_update_triton(xd, s2, weight, bias, slots[:2]))
    assert torch.equal(s1, s2)
