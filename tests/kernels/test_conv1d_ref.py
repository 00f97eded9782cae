"""The torch short-conv reference against F.conv1d, plus the backend dispatch."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from shortconv.kernels import causal_conv1d_fn, causal_conv1d_update, resolve_backend
from shortconv.kernels.conv1d_ref import causal_conv1d_fn_ref, causal_conv1d_update_ref

N_SLOTS = 12
LENS = (5, 1, 2, 33)


def conv_oracle(
    seq: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, init: torch.Tensor
) -> torch.Tensor:
    """F.conv1d over one sequence [dim, L] left-padded with its initial state [dim, W-1]."""
    u = torch.cat([init, seq], dim=1).double()[None]
    b = None if bias is None else bias.double()
    return F.conv1d(u, weight.double()[:, None, :], b, groups=weight.shape[0])[0]


def make_batch(dim: int, width: int, idx_dtype: torch.dtype, pad_slot_id: int, seed: int = 0):
    """Packed batch: LENS plus a pad row (len 3) in the middle, permuted slots, mixed init."""
    g = torch.Generator().manual_seed(seed)
    lens = [LENS[0], LENS[1], 3, LENS[2], LENS[3]]
    total = sum(lens)
    # x is a transposed column slice of a [T, 3*dim] projection: non-contiguous on purpose.
    proj = torch.randn(total, 3 * dim, generator=g) + 0.5
    x = proj[:, dim : 2 * dim].t()
    weight = torch.randn(dim, width, generator=g)
    bias = torch.randn(dim, generator=g)
    states = torch.randn(N_SLOTS, dim, width - 1, generator=g) + 0.5
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([9, 4, pad_slot_id, 7, 5], dtype=idx_dtype)
    has_init = torch.tensor([True, False, True, True, False])
    return x, weight, bias, states, qsl, slots, has_init


def expected(x, weight, bias, states, qsl, slots, has_init, pad_slot_id):
    """Per-request loop over F.conv1d: (outputs [dim, T], {slot: new state})."""
    dim, width = weight.shape
    out = torch.zeros(x.shape, dtype=torch.float64)
    new_states = {}
    for b in range(slots.numel()):
        s, e, slot = int(qsl[b]), int(qsl[b + 1]), int(slots[b])
        if slot == pad_slot_id:
            continue
        init = states[slot] if has_init[b] else torch.zeros(dim, width - 1)
        out[:, s:e] = conv_oracle(x[:, s:e], weight, bias, init)
        new_states[slot] = torch.cat([init, x[:, s:e]], dim=1)[:, -(width - 1) :]
    return out, new_states


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dim", [7, 33])
@pytest.mark.parametrize("width", [2, 3, 4, 5, 6, 7, 8])
def test_fn_matches_conv1d(width: int, dim: int, idx_dtype: torch.dtype) -> None:
    pad = -1
    x, weight, bias, states, qsl, slots, has_init = make_batch(dim, width, idx_dtype, pad)
    before = states.clone()
    want_out, want_states = expected(x, weight, bias, before, qsl, slots, has_init, pad)
    out = causal_conv1d_fn_ref(x, weight, bias, states, qsl, slots, has_init, pad)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    # The pad row (tokens 6:9) is zeroed.
    assert torch.count_nonzero(out[:, 6:9]) == 0
    for slot in range(N_SLOTS):
        if slot in want_states:
            torch.testing.assert_close(states[slot], want_states[slot].to(states.dtype))
        else:  # every slot no live row owns, incl. pad's clamp targets 0 and -1, is bit-identical
            assert torch.equal(states[slot], before[slot]), slot


@pytest.mark.parametrize("pad_slot_id", [-1, 2])
@pytest.mark.parametrize("width", [2, 5, 7, 8])
def test_pad_slot_and_neighbours_untouched(width: int, pad_slot_id: int) -> None:
    x, weight, bias, states, qsl, slots, has_init = make_batch(7, width, torch.int64, pad_slot_id)
    before = states.clone()
    causal_conv1d_fn_ref(x, weight, bias, states, qsl, slots, has_init, pad_slot_id)
    for slot in (0, pad_slot_id - 1, pad_slot_id, pad_slot_id + 1, N_SLOTS - 1):
        assert torch.equal(states[slot], before[slot]), slot
    xd = torch.randn(3, 7) + 0.5
    idx = torch.tensor([9, pad_slot_id, 8])
    before = states.clone()
    out = causal_conv1d_update_ref(xd, states, weight, bias, idx, pad_slot_id)
    assert torch.count_nonzero(out[1]) == 0
    for slot in (0, pad_slot_id - 1, pad_slot_id, pad_slot_id + 1, N_SLOTS - 1):
        assert torch.equal(states[slot], before[slot]), slot


def test_pad_row_does_not_clobber_live_slot_zero() -> None:
    """Pad rows are redirected internally; a live row on slot 0 must still get its state."""
    dim, width, pad = 7, 4, -1
    x, weight, bias, states, qsl, _, has_init = make_batch(dim, width, torch.int64, pad)
    slots = torch.tensor([0, 4, pad, 7, 5])
    before = states.clone()
    _, want_states = expected(x, weight, bias, before, qsl, slots, has_init, pad)
    causal_conv1d_fn_ref(x, weight, bias, states, qsl, slots, has_init, pad)
    torch.testing.assert_close(states[0], want_states[0])
    xd = torch.randn(3, dim) + 0.5
    prev = states[0].clone()
    causal_conv1d_update_ref(xd, states, weight, bias, torch.tensor([pad, 0, pad]), pad)
    assert torch.equal(states[0], torch.cat([prev, xd[1, :, None]], dim=1)[:, 1:])


@pytest.mark.parametrize("width", [2, 3, 4, 5, 6, 7, 8])
def test_short_sequence_state_keeps_prior_columns(width: int) -> None:
    dim = 5
    x = torch.randn(dim, 1) + 0.5
    weight, bias = torch.randn(dim, width), None
    states = torch.randn(3, dim, width - 1) + 0.5
    before = states.clone()
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    for init in (True, False):
        st = before.clone()
        causal_conv1d_fn_ref(x, weight, bias, st, qsl, torch.tensor([2]), torch.tensor([init]))
        prior = before[2] if init else torch.zeros(dim, width - 1)
        assert torch.equal(st[2], torch.cat([prior, x], dim=1)[:, 1:])


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("width", [2, 3, 4, 5, 6, 7, 8])
def test_update_steps_equal_fn(width: int, idx_dtype: torch.dtype) -> None:
    """Prefill a prefix, then decode token by token == one prefill over all tokens."""
    dim, steps, prefix = 33, 4, (3, 1, 6)
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    init = torch.randn(N_SLOTS, dim, width - 1, generator=g) + 0.5
    slots = torch.tensor([10, 2, 5], dtype=idx_dtype)
    has_init = torch.tensor([True, False, True])
    seqs = [torch.randn(dim, n + steps, generator=g) + 0.5 for n in prefix]

    full_states = init.clone()
    full_x = torch.cat(seqs, dim=1)
    qsl = torch.tensor([0, *torch.tensor([s.shape[1] for s in seqs]).cumsum(0).tolist()])
    full = causal_conv1d_fn_ref(full_x, weight, bias, full_states, qsl, slots, has_init)

    states = init.clone()
    pre_x = torch.cat([s[:, :n] for s, n in zip(seqs, prefix, strict=True)], dim=1)
    pre_qsl = torch.tensor([0, *torch.tensor(prefix).cumsum(0).tolist()], dtype=torch.int32)
    pre = causal_conv1d_fn_ref(pre_x, weight, bias, states, pre_qsl, slots, has_init)
    for b, n in enumerate(prefix):
        torch.testing.assert_close(
            pre[:, pre_qsl[b] : pre_qsl[b + 1]], full[:, qsl[b] : qsl[b] + n]
        )
    for step in range(steps):
        # Decode rows are a non-contiguous slice, as in a fused projection.
        xd = torch.stack([s[:, n + step] for s, n in zip(seqs, prefix, strict=True)])
        xd = torch.cat([xd, xd], dim=1)[:, :dim]
        got = causal_conv1d_update_ref(xd, states, weight, bias, slots)
        want = torch.stack([full[:, int(qsl[b]) + n + step] for b, n in enumerate(prefix)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, full_states)


def test_bf16_accumulates_in_fp32() -> None:
    x, weight, bias, states, qsl, slots, has_init = make_batch(33, 4, torch.int64, -1)
    bf = [t.to(torch.bfloat16) for t in (x, weight, bias, states)]
    want = causal_conv1d_fn_ref(*[t.float() for t in bf[:3]], bf[3].float(), qsl, slots, has_init)
    got = causal_conv1d_fn_ref(*bf, qsl, slots, has_init)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)


def test_out_argument_and_tail_tokens() -> None:
    x, weight, bias, states, qsl, slots, has_init = make_batch(7, 3, torch.int64, -1)
    tail = torch.cat([x, torch.randn(7, 4) + 0.5], dim=1)  # 4 graph-padding tokens
    out = torch.full(tail.shape, float("nan"))
    got = causal_conv1d_fn_ref(tail, weight, bias, states.clone(), qsl, slots, has_init, out=out)
    assert got is out and not out.isnan().any()
    assert torch.count_nonzero(out[:, -4:]) == 0
    want = causal_conv1d_fn_ref(x, weight, bias, states, qsl, slots, has_init)
    torch.testing.assert_close(out[:, :-4], want)


def test_dispatch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("SHORTCONV_KERNELS", raising=False)
    assert (resolve_backend(cpu), resolve_backend(cuda)) == ("torch", "triton")
    monkeypatch.setenv("SHORTCONV_KERNELS", "torch")
    assert resolve_backend(cuda) == "torch"
    x, weight, bias, states, qsl, slots, has_init = make_batch(7, 4, torch.int64, -1)
    s1, s2 = states.clone(), states.clone()
    got = causal_conv1d_fn(x, weight, bias, s1, qsl, slots, has_init)
    assert torch.equal(got, causal_conv1d_fn_ref(x, weight, bias, s2, qsl, slots, has_init))
    xd = torch.randn(2, 7)
    idx = torch.tensor([1, 2])
    got = causal_conv1d_update(xd, s1, weight, bias, idx)
    assert torch.equal(got, causal_conv1d_update_ref(xd, s2, weight, bias, idx))
    assert torch.equal(s1, s2)
    monkeypatch.setenv("SHORTCONV_KERNELS", "cuda")
    with pytest.raises(ValueError, match="SHORTCONV_KERNELS"):
        resolve_backend(cpu)


def test_dispatch_without_triton_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "shortconv.kernels.conv1d_triton", None)
    monkeypatch.setenv("SHORTCONV_KERNELS", "triton")
    xd, states, weight = torch.randn(2, 7), torch.randn(3, 7, 3), torch.randn(7, 4)
    with pytest.raises(RuntimeError, match=r"pip install triton==3\.8\.0"):
        causal_conv1d_update(xd, states, weight, None, torch.tensor([0, 1]))
