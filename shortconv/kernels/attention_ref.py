"""Paged causal attention in pure PyTorch: the references.

* `paged_attention_ref`: the step's padded layout through one batched SDPA call (the torch path
  off CPU, and what the CPU fast path in `attention_cpu` is checked against);
* `paged_attention_decode_ref` / `paged_attention_extend_ref`: plain per-sequence fp32 oracles
  with the Triton kernels' signatures (`attention_triton`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shortconv.kernels.attention_dense import dense_indices
from shortconv.kernels.attention_step import PagedAttentionStep
from shortconv.kernels.scratch import StepScratch


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V `[T, Hk, d]` into flat page rows `[pages*page_size, Hk, d]`."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: PagedAttentionStep,
    scale: float,
    scratch: StepScratch | None = None,
    window: int = 0,
) -> torch.Tensor:
    """q `[T, Hq, d]` (new tokens, packed) → out `[T, Hq, d]`, attending over each sequence's
    context gathered from its pages (`attention_dense`: kv_gather, attn_mask) in one padded SDPA
    call; `window` > 0: a query at p sees only p-window+1 .. p (0: the whole context). GQA: Hq
    must be a multiple of Hk. The torch path off CPU; the CPU fast path in `attention_cpu` is
    checked against it."""
    num_tokens, num_heads, head_dim = q.shape
    b, max_q = step.num_seqs, step.max_query_len
    dense = dense_indices(step, scratch, window)
    q_rows = torch.cat([q, q.new_zeros(1, num_heads, head_dim)], dim=0)
    q_pad = q_rows[dense.q_pad_index].view(b, max_q, num_heads, head_dim).transpose(1, 2)
    keys = k_cache[dense.kv_gather].transpose(1, 2)  # [B, Hk, L, d]
    values = v_cache[dense.kv_gather].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q_pad,
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=dense.attn_mask[:, None],
        scale=scale,
        enable_gqa=keys.shape[1] != num_heads,
    )
    out = out.transpose(1, 2).reshape(b * max_q, num_heads, head_dim)
    return out[dense.q_unpad_index]


def _attend_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    page_size: int,
    window: int,
) -> torch.Tensor:
    """q [n, Hq, d], the sequence's last n positions, over its first seq_len positions (only
    the last `window` up to each query when window > 0; no other page is read)."""
    n, num_heads, _ = q.shape
    first = max(0, seq_len - n - window + 1) if window > 0 else 0
    pos = torch.arange(first, seq_len, device=q.device)
    rows = table.to(torch.int64)[pos // page_size] * page_size + pos % page_size
    group = num_heads // k_cache.shape[1]
    keys = k_cache[rows].float().repeat_interleave(group, dim=1)  # [L, Hq, d]
    values = v_cache[rows].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
    hidden = pos[None, None, :] > q_pos[None, :, None]
    if window > 0:
        hidden |= pos[None, None, :] <= q_pos[None, :, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)


def paged_attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Oracle of `paged_attention_decode_triton`: q [B, Hq, d] at positions seq_lens-1,
    k/v_cache [N, Hk, d], block_tables [B, P], seq_lens [B] -> out [B, Hq, d]; `window` > 0:
    each query sees its last `window` positions."""
    result = torch.empty_like(q) if out is None else out
    for b, seq_len in enumerate(seq_lens.tolist()):
        one = _attend_one(
            q[b : b + 1], k_cache, v_cache, block_tables[b], seq_len, scale, page_size, window
        )
        result[b] = one[0].to(result.dtype)
    return result


def paged_attention_extend_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    page_size: int,
    *,
    max_query_len: int,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Oracle of `paged_attention_extend_triton`: q [T, Hq, d] packed by query_start_loc
    [B+1]; sequence b's n_b queries sit at positions seq_lens[b]-n_b .. seq_lens[b]-1 and
    attend causally over its paged context (the last `window` positions when window > 0)
    -> out [T, Hq, d]. `max_query_len` is unused here."""
    del max_query_len
    result = torch.empty_like(q) if out is None else out
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = qsl[b], qsl[b + 1]
        if hi > lo:
            one = _attend_one(
                q[lo:hi], k_cache, v_cache, block_tables[b], seq_len, scale, page_size, window
            )
            result[lo:hi] = one.to(result.dtype)
    return result
