"""The CPU verify-step path of the varlen short conv equals the reference it shortcuts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shortconv.kernels.conv1d_verify_cpu as verify_cpu
from shortconv.kernels.conv1d_ref import causal_conv1d_fn_ref
from shortconv.kernels.conv1d_verify_cpu import causal_conv1d_fn_cpu, verify_conv1d_cpu
from shortconv.kernels.state_checkpoint import save_state_checkpoints
from shortconv.kernels.state_checkpoint_ref import save_state_checkpoints_ref


def _case(lens: list[int], width: int, resumed: list[bool], seed: int, n_slots: int = 9) -> tuple:
    g = torch.Generator().manual_seed(seed)
    dim = 12
    x = torch.randn(sum(lens), dim, generator=g).t()  # [dim, T], strided like the layer's
    weight = torch.randn(dim, width, generator=g)
    bias = torch.randn(dim, generator=g)
    states = torch.randn(n_slots, dim, width - 1, generator=g)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.randperm(n_slots - 1, generator=g)[: len(lens)] + 1  # never scratch slot 0
    return x, weight, bias, states, qsl, slots, torch.tensor(resumed)


@pytest.mark.parametrize("width", [2, 3, 4, 8])
@pytest.mark.parametrize(
    ("lens", "resumed"),
    [
        ([5], [True]),  # the batch-1 verify row: fast path
        ([3, 3, 3], [True] * 3),  # equal verify rows: fast path
        ([1, 1], [True, True]),  # width-1 rows
        ([5, 3], [True, True]),  # unequal: reference
        ([4, 4], [True, False]),  # a fresh prompt chunk: reference
    ],
)
def test_verify_path_equals_reference(lens: list[int], resumed: list[bool], width: int) -> None:
    x, w, b, states, qsl, slots, init = _case(lens, width, resumed, seed=width + len(lens))
    want_states, got_states = states.clone(), states.clone()
    want = causal_conv1d_fn_ref(x, w, b, want_states, qsl, slots, init)
    got = causal_conv1d_fn_cpu(x, w, b, got_states, qsl, slots, init)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_states, want_states, rtol=0, atol=0)


def test_fast_path_taken_only_when_rows_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path is what runs on equal resumed rows (so the test above compares it), and
    a pad row or unequal lengths go to the reference."""
    calls: list[int] = []
    real = verify_cpu.causal_conv1d_fn_ref

    def counted(*a: Any, **kw: Any) -> torch.Tensor:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(verify_cpu, "causal_conv1d_fn_ref", counted)
    x, w, b, states, qsl, slots, init = _case([5, 5], 3, [True, True], seed=0)
    causal_conv1d_fn_cpu(x, w, b, states, qsl, slots, init)
    assert calls == []
    causal_conv1d_fn_cpu(x, w, b, states, qsl, torch.tensor([slots[0].item(), -1]), init)
    x2, w2, b2, s2, q2, sl2, i2 = _case([5, 4], 3, [True, True], seed=1)
    causal_conv1d_fn_cpu(x2, w2, b2, s2, q2, sl2, i2)
    assert calls == [1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 3, 4, 8])
@pytest.mark.parametrize("lens", [[5], [3, 3, 3], [2, 2]])
def test_fused_verify_conv_is_the_per_layer_path_bit_for_bit(
    lens: list[int], width: int, dtype: torch.dtype
) -> None:
    """One scatter of every verify state equals the per-layer path it replaces (the spec-slot
    checkpoints, then the conv that updates the live slots), bit for bit: outputs and every
    slot of the pool; and its states equal the references' exactly."""
    q, batch = lens[0], len(lens)
    case = _case(lens, width, [True] * batch, seed=width * 10 + q, n_slots=batch * q + 3)
    x, w, b, states, qsl, slots, init = (t.to(dtype) if t.is_floating_point() else t for t in case)
    free = [s for s in range(1, states.shape[0]) if s not in slots.tolist()]
    spec = torch.tensor(free[: batch * (q - 1)]).view(batch, q - 1)
    ck_seq = torch.arange(batch).repeat_interleave(q - 1)
    ck_len = torch.arange(1, q).repeat(batch)
    ckpt = (ck_seq, ck_len, spec.reshape(-1))
    state_slots = torch.cat([spec, slots[:, None]], dim=1).reshape(-1)

    want_states, ref_states, got_states = states.clone(), states.clone(), states.clone()
    save_state_checkpoints(x, want_states, qsl, slots, init, *ckpt)
    want = causal_conv1d_fn_cpu(x, w, b, want_states, qsl, slots, init)
    save_state_checkpoints_ref(x, ref_states, qsl, slots, init, *ckpt)
    ref = causal_conv1d_fn_ref(x, w, b, ref_states, qsl, slots, init)
    got = verify_conv1d_cpu(x, w, b, got_states, slots, q, state_slots)

    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(got_states, want_states) and torch.equal(got_states, ref_states)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    assert not torch.equal(got_states, states)  # it wrote something
