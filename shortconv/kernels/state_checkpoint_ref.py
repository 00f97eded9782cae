"""Reference for prefix-cache state checkpoints taken inside a prefill chunk (the oracle).

A conv-like state (LFM2's short conv, ZAYA1's CCA conv: `[n_slots, C, K]`, the last K raw input
columns; ZAYA1's previous-token value viewed as `[n_slots, D, 1]`) after j tokens of a chunk is
the last K columns of [the chunk's initial state (zeros when fresh) ‖ its first j input columns].
"""

from __future__ import annotations

import torch


def save_state_checkpoints_ref(
    x: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    ckpt_seq: torch.Tensor,
    ckpt_len: torch.Tensor,
    ckpt_slot: torch.Tensor,
) -> None:
    """state[ckpt_slot[i]] = state of sequence ckpt_seq[i] after its first ckpt_len[i] tokens.

    Shapes: x [C, T] (the layer's packed state inputs), state [n_slots, C, K], query_start_loc
    int [B+1], cache_indices int [B], has_initial_state bool [B], ckpt_* int [N]. Must run
    before the layer's kernel updates the sequences' own slots (it reads their initial state).
    """
    k = state.shape[-1]
    for b, j, dst in zip(ckpt_seq.tolist(), ckpt_len.tolist(), ckpt_slot.tolist(), strict=True):
        start = int(query_start_loc[b])
        init = state[int(cache_indices[b])].clone()
        if not bool(has_initial_state[b]):
            init.zero_()
        u = torch.cat([init, x[:, start : start + j].to(state.dtype)], dim=1)
        state[dst] = u[:, u.shape[1] - k :]
