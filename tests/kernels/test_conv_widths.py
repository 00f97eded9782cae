"""Short convs of every width (LFM2's 3, LFM3's 7, and around them) in a padded graph-style
batch: a pad row (pad_slot_id), rows on the scratch slot 0 (how a padded graph bucket fills its
spare rows), tokens past query_start_loc[-1], sequences shorter than the conv state and resumed
ones. The Triton kernels (interpreted on CPU) and the CPU decode path against the references.
"""

from __future__ import annotations

import pytest
import torch

from shortconv.kernels.conv1d_cpu import causal_conv1d_update_cpu
from shortconv.kernels.conv1d_ref import causal_conv1d_fn_ref, causal_conv1d_update_ref

PAD = -1
N_SLOTS = 8
WIDTHS = [2, 3, 4, 6, 7, 8]
# Sequences (tokens, slot, resumed): shorter than and as long as a width-8 state, on slot 0.
ROWS = [(3, 5, True), (1, 2, True), (4, PAD, True), (9, 6, False), (2, 0, False), (7, 3, True)]
EXTRA_TOKENS = 3  # graph padding past query_start_loc[-1]


def _batch(width: int, dim: int = 12) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(width)
    total = sum(n for n, _, _ in ROWS)
    x = (torch.randn(total + EXTRA_TOKENS, 2 * dim, generator=g) + 0.5)[:, :dim].t()
    weight = torch.randn(dim, width, generator=g)
    bias = torch.randn(dim, generator=g)
    states = torch.randn(N_SLOTS, dim, width - 1, generator=g) + 0.5
    lens = torch.tensor([n for n, _, _ in ROWS])
    qsl = torch.cat([torch.zeros(1), lens.cumsum(0)]).to(torch.int32)
    slots = torch.tensor([s for _, s, _ in ROWS])
    has_init = torch.tensor([r for _, _, r in ROWS])
    return x, weight, bias, states, qsl, slots, has_init


@pytest.mark.parametrize("width", WIDTHS)
def test_triton_varlen_conv_of_every_width(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from shortconv.kernels.conv1d_triton import causal_conv1d_fn_triton

    x, weight, bias, states, qsl, slots, has_init = _batch(width)
    ref_states = states.clone()
    want = causal_conv1d_fn_ref(x, weight, bias, ref_states, qsl, slots, has_init, PAD)
    out = torch.full(x.shape, float("nan"))
    causal_conv1d_fn_triton(x, weight, bias, states, qsl, slots, has_init, PAD, out=out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not out[:, -EXTRA_TOKENS:].any()  # tokens past the packed ones: zeros
    assert torch.equal(states, ref_states)  # slot 0 included: one row owns it here


@pytest.mark.parametrize("width", WIDTHS)
def test_triton_decode_conv_of_every_width(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps on a graph-style batch: two spare rows share scratch slot 0 (their outputs
    and slot 0 are garbage by design), a pad row, and live rows whose states must follow the
    reference's exactly."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from shortconv.kernels.conv1d_triton import causal_conv1d_update_triton

    _, weight, bias, states, *_ = _batch(width)
    ref_states = states.clone()
    idx = torch.tensor([5, 0, PAD, 2, 0, 7])
    live = torch.tensor([True, False, False, True, False, True])
    for step in range(width + 1):  # past a full turn of the state
        xd = torch.randn(idx.numel(), weight.shape[0]) + 0.5
        want = causal_conv1d_update_ref(xd, ref_states, weight, bias, idx, PAD)
        got = causal_conv1d_update_triton(xd, states, weight, bias, idx, PAD)
        torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5)
        assert not got[2].any()
        assert torch.equal(states[1:], ref_states[1:]), step


@pytest.mark.parametrize("width", WIDTHS)
def test_cpu_decode_conv_of_every_width(width: int) -> None:
    """The CPU fast path (all rows live) and its fallback (a pad row, a scratch-slot row) equal
    the reference bit for bit, steps after steps."""
    _, weight, bias, states, *_ = _batch(width)
    for idx in (torch.tensor([5, 1, 2, 7]), torch.tensor([5, PAD, 2, 0])):
        fast, ref = states.clone(), states.clone()
        for _ in range(width + 1):
            xd = torch.randn(idx.numel(), weight.shape[0])
            got = causal_conv1d_update_cpu(xd, fast, weight, bias, idx, PAD)
            want = causal_conv1d_update_ref(xd, ref, weight, bias, idx, PAD)
            assert torch.equal(got, want) and torch.equal(fast, ref)


@pytest.mark.parametrize("width", [3, 7])
def test_varlen_then_decode_equals_one_longer_prefill(width: int) -> None:
    """The reference's state after a chunk (shorter than its state, and longer) resumes into
    decode steps that continue the same convolution."""
    x, weight, bias, states, *_ = _batch(width)
    dim = weight.shape[0]
    slot = torch.tensor([4])
    whole = states.clone()
    qsl = torch.tensor([0, 10], dtype=torch.int32)
    fresh = torch.tensor([False])
    full = causal_conv1d_fn_ref(x[:, :10], weight, bias, whole, qsl, slot, fresh)
    for cut in (2, width + 1):
        part = states.clone()
        head = torch.tensor([0, cut], dtype=torch.int32)
        causal_conv1d_fn_ref(x[:, :cut], weight, bias, part, head, slot, fresh)
        for t in range(cut, 10):
            got = causal_conv1d_update_ref(x[:, t][None], part, weight, bias, slot)
            torch.testing.assert_close(got[0], full[:, t], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(part[4], whole[4])
        assert part[4].shape == (dim, width - 1)
