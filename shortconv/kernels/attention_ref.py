"""Paged causal attention in pure PyTorch (the reference; batched, no per-request host loop)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shortconv.step_tensors import StepTensors


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
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepTensors, scale: float
) -> torch.Tensor:
    """q `[T, Hq, d]` (new tokens, packed) → out `[T, Hq, d]`, attending over each sequence's
    context gathered from its pages. GQA: Hq must be a multiple of Hk."""
    num_tokens, num_heads, head_dim = q.shape
    b, max_q = step.num_seqs, step.max_query_len
    q_rows = torch.cat([q, q.new_zeros(1, num_heads, head_dim)], dim=0)
    q_pad = q_rows[step.q_pad_index].view(b, max_q, num_heads, head_dim).transpose(1, 2)
    keys = k_cache[step.kv_gather].transpose(1, 2)  # [B, Hk, L, d]
    values = v_cache[step.kv_gather].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q_pad,
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=step.attn_mask[:, None],
        scale=scale,
        enable_gqa=keys.shape[1] != num_heads,
    )
    out = out.transpose(1, 2).reshape(b * max_q, num_heads, head_dim)
    return out[step.q_unpad_index]
