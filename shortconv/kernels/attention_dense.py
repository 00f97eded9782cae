"""The torch attention path's dense layout, derived from the step's block tables.

The paged Triton kernels read `block_tables` and `seq_lens` in place; the torch paths
(`attention_cpu`, `attention_ref.paged_attention_ref`) attend over a padded `[B, Q, L]` layout
instead, which they derive here from the same step tensors, once per step (cached in the
backend's `StepScratch` where there is one). Device ops on fixed shapes with host ints only
(B, Q, L, T from the step): capturable, so a captured decode step on the torch path rebuilds
them from its refreshed buffers on every replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shortconv.kernels.attention_step import PagedAttentionStep
from shortconv.kernels.scratch import StepScratch


@dataclass(frozen=True)
class DenseAttentionIndices:
    """B = sequences, Q = longest chunk, L = `step.max_seq_len`, T = new tokens.

    kv_gather int64 [B, L] (flat KV row of each context position, scratch row 0 past the end);
    attn_mask bool [B, Q, L]; q_pad_index int64 [B*Q] into T+1 rows (row T is a zero row);
    q_unpad_index int64 [T] into B*Q.
    """

    kv_gather: torch.Tensor
    attn_mask: torch.Tensor
    q_pad_index: torch.Tensor
    q_unpad_index: torch.Tensor


def dense_indices(
    step: PagedAttentionStep, scratch: StepScratch | None = None
) -> DenseAttentionIndices:
    """The step's dense layout; with `scratch`, built once per step and shared by its layers."""
    if scratch is None:
        return _build(step)
    return scratch.per_step("dense_attention", lambda: _build(step))


def _build(step: PagedAttentionStep) -> DenseAttentionIndices:
    dev, page, b = step.block_tables.device, step.page_size, step.num_seqs
    ctx = torch.arange(step.max_seq_len, device=dev)
    in_page = torch.arange(page, device=dev)
    flat = (step.block_tables[:, :, None] * page + in_page).view(b, -1)[:, : step.max_seq_len]
    kv_gather = torch.where(ctx < step.seq_lens[:, None], flat, torch.zeros_like(flat))
    if step.max_query_len == 1 and step.num_tokens == step.num_seqs:
        # One query per row (decode, graph buckets): row i is token i, which sees 0..position.
        rows = step.token_seq_index
        return DenseAttentionIndices(
            kv_gather, (ctx <= step.positions[:, None])[:, None], rows, rows
        )
    qsl = step.query_start_loc.to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    qi = torch.arange(step.max_query_len, device=dev)
    live_q = qi < lens[:, None]  # [B, Q]
    q_pos = (step.seq_lens - lens)[:, None] + qi
    mask = (ctx <= q_pos[:, :, None]) & live_q[:, :, None]
    # NOTE: padded query rows attend to position 0 only, so softmax never sees an all-masked row.
    mask[:, :, 0] |= ~live_q
    num_tokens = step.num_tokens
    q_pad = torch.where(
        live_q, qsl[:-1, None] + qi, torch.full_like(live_q, num_tokens, dtype=torch.int64)
    )
    tok = step.token_seq_index
    q_unpad = tok * step.max_query_len + torch.arange(num_tokens, device=dev) - qsl[tok]
    return DenseAttentionIndices(kv_gather, mask, q_pad.reshape(-1), q_unpad)
