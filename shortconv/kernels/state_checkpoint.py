"""Prefix-cache state checkpoints inside a prefill chunk, vectorised (any device, no host sync).

Same contract as `state_checkpoint_ref.save_state_checkpoints_ref`. Not a Triton kernel: it
is a gather and a scatter of N x C x K values, run only on extend steps that carry checkpoints
(never inside a captured decode graph), which torch's indexing kernels already do in one pass.
"""

from __future__ import annotations

import torch


def save_state_checkpoints(
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

    x [C, T], state [n_slots, C, K], ckpt_* int64 [N] on state's device. Reads the sequences'
    initial states, so it runs before the layer's kernel updates them.
    """
    n, (chans, k) = ckpt_seq.numel(), state.shape[1:]
    if n == 0:
        return
    taps = torch.arange(k, device=state.device)
    off = ckpt_len[:, None] - k + taps[None, :]  # [N, K]: offset in the chunk; < 0: initial state
    start = query_start_loc.to(torch.int64)[ckpt_seq]
    from_x = x[:, (start[:, None] + off).clamp(min=0)].permute(1, 0, 2)  # [N, C, K]
    init = state[cache_indices.to(torch.int64)[ckpt_seq]]  # [N, C, K]
    resumed = has_initial_state.to(torch.bool)[ckpt_seq][:, None, None]
    init = torch.where(resumed, init, torch.zeros_like(init))
    init_col = (k + off).clamp(0, k - 1)[:, None, :].expand(n, chans, k)
    from_init = init.gather(2, init_col)
    value = torch.where((off >= 0)[:, None, :], from_x.to(state.dtype), from_init)
    state[ckpt_slot] = value
