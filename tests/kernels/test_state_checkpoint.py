"""The in-chunk state checkpoint against its reference, and against the state a real kernel
leaves after exactly that many tokens (the meaning of a checkpoint)."""

from __future__ import annotations

import pytest
import torch

from shortconv.kernels.conv1d_ref import causal_conv1d_fn_ref
from shortconv.kernels.state_checkpoint import save_state_checkpoints
from shortconv.kernels.state_checkpoint_ref import save_state_checkpoints_ref


def _case(k: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(k)
    chans, lens = 6, [7, 2, 5]
    x = torch.randn(chans, sum(lens), generator=g).to(dtype)
    state = torch.randn(12, chans, k, generator=g).to(dtype)
    qsl = torch.tensor([0, 7, 9, 14], dtype=torch.int32)
    slots = torch.tensor([3, 1, 5])
    has_init = torch.tensor([True, False, True])
    # Offsets shorter and longer than K, on a fresh and on resumed sequences.
    seq, length, dst = (
        torch.tensor(v) for v in ([0, 0, 0, 1, 2], [1, k, 6, 1, 4], [7, 8, 9, 10, 11])
    )
    return x, state, qsl, slots, has_init, seq, length, dst


@pytest.mark.parametrize("k", [1, 2, 3, 5, 6, 7])  # K = W - 1 of short convs up to width 8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vectorised_equals_reference(k: int, dtype: torch.dtype) -> None:
    x, state, *rest = _case(k, dtype)
    a, b = state.clone(), state.clone()
    save_state_checkpoints(x, a, *rest)
    save_state_checkpoints_ref(x, b, *rest)
    assert torch.equal(a, b)
    untouched = [i for i in range(12) if i not in (7, 8, 9, 10, 11)]
    assert torch.equal(a[untouched], state[untouched])  # only the checkpoint slots changed


@pytest.mark.parametrize("width", [2, 3, 4, 7, 8])
def test_checkpoint_equals_the_state_after_that_many_tokens(width: int) -> None:
    torch.manual_seed(0)
    dim, t = 5, 9
    x = torch.randn(dim, t)
    w = torch.randn(dim, width)
    init = torch.randn(dim, width - 1)
    for j in range(1, t):
        states = torch.zeros(4, dim, width - 1)
        states[1] = init
        qsl = torch.tensor([0, t], dtype=torch.int32)
        one = torch.ones(1, dtype=torch.bool)
        save_state_checkpoints(
            x,
            states,
            qsl,
            torch.tensor([1]),
            one,
            torch.tensor([0]),
            torch.tensor([j]),
            torch.tensor([2]),
        )
        after = torch.zeros(4, dim, width - 1)
        after[1] = init
        causal_conv1d_fn_ref(
            x[:, :j].contiguous(),
            w,
            None,
            after,
            torch.tensor([0, j], dtype=torch.int32),
            torch.tensor([1]),
            one,
        )
        assert torch.equal(states[2], after[1]), j
