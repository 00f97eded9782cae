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

    With a `window` w > 0 (`_build_windowed`) column c of row b is position start_b + c, where
    start_b is the first position the row's first query sees, and L = min(L, w + Q - 1): the
    layout holds only the positions some query of the row sees.
    """

    kv_gather: torch.Tensor
    attn_mask: torch.Tensor
    q_pad_index: torch.Tensor
    q_unpad_index: torch.Tensor
    window: int = 0

    def columns(self, max_len: int, max_query_len: int) -> int:
        """The columns a group of rows needs: contexts up to `max_len`, chunks up to
        `max_query_len` queries."""
        if self.window <= 0:
            return max_len
        return min(max_len, self.window + max_query_len - 1, self.kv_gather.shape[1])


def dense_indices(
    step: PagedAttentionStep, scratch: StepScratch | None = None, window: int = 0
) -> DenseAttentionIndices:
    """The step's dense layout for a layer of attention window `window` (0: the whole
    context); with `scratch`, built once per step (and window) and shared by its layers."""
    if window > 0:
        if scratch is None:
            return _build_windowed(step, window)
        return scratch.per_step(("dense_attention", window), lambda: _build_windowed(step, window))
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
    q_pad, q_unpad = _query_rows(step, qsl, live_q)
    return DenseAttentionIndices(kv_gather, mask, q_pad, q_unpad)


def _query_rows(
    step: PagedAttentionStep, qsl: torch.Tensor, live_q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_pad_index [B*Q], q_unpad_index [T]) of a multi-token step; qsl int64 [B+1]."""
    num_tokens, dev = step.num_tokens, qsl.device
    qi = torch.arange(step.max_query_len, device=dev)
    q_pad = torch.where(
        live_q, qsl[:-1, None] + qi, torch.full_like(live_q, num_tokens, dtype=torch.int64)
    )
    tok = step.token_seq_index
    q_unpad = tok * step.max_query_len + torch.arange(num_tokens, device=dev) - qsl[tok]
    return q_pad.reshape(-1), q_unpad


def _build_windowed(step: PagedAttentionStep, window: int) -> DenseAttentionIndices:
    """The layout of a sliding-window layer: each row gathers only the positions its queries
    see (a query at p sees p-window+1 .. p)."""
    decode = step.max_query_len == 1 and step.num_tokens == step.num_seqs
    if decode:  # one query per row, row i is token i (as `_build`: graph buckets too)
        lens = torch.ones_like(step.positions)
        last = step.positions
    else:
        qsl = step.query_start_loc.to(torch.int64)
        lens = qsl[1:] - qsl[:-1]
        last = step.seq_lens - 1
    width = min(step.max_seq_len, window + step.max_query_len - 1)
    first_q = last + 1 - lens  # position of each row's first new token
    start = (first_q - window + 1).clamp(min=0)
    kv_gather = _window_rows(step, start, last, width)
    qi = torch.arange(step.max_query_len, device=start.device)
    live_q = qi < lens[:, None]  # [B, Q]
    q_pos = (first_q[:, None] + qi)[:, :, None]
    ctx = start[:, None, None] + torch.arange(width, device=start.device)
    mask = (ctx <= q_pos) & (ctx > q_pos - window) & live_q[:, :, None]
    if decode:
        rows = step.token_seq_index
        return DenseAttentionIndices(kv_gather, mask, rows, rows, window)
    # NOTE: padded query rows attend to column 0 only, so softmax never sees an all-masked row.
    mask[:, :, 0] |= ~live_q
    q_pad, q_unpad = _query_rows(step, qsl, live_q)
    return DenseAttentionIndices(kv_gather, mask, q_pad, q_unpad, window)


def _window_rows(
    step: PagedAttentionStep, start: torch.Tensor, last: torch.Tensor, width: int
) -> torch.Tensor:
    """int64 [B, width]: the flat KV row of positions start_b .. start_b + width - 1.

    NOTE: a sliding layer's block table may hold scratch page 0 at pages wholly before the
    window (freed), and page 0 holds anything; so no column reads a position outside the row's
    window span: columns past a row's context repeat its last position (and are masked)."""
    page = step.page_size
    pos = start[:, None] + torch.arange(width, device=start.device)
    pos = torch.minimum(pos, last.clamp(min=0)[:, None])
    tables = step.block_tables.to(torch.int64)
    return tables.gather(1, pos // page) * page + pos % page
