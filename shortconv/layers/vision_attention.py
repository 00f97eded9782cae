"""Bidirectional attention of the vision encoder over a padded batch of images.

NOTE: torch's SDPA on the torch path; under `SHORTCONV_KERNELS=triton` (the GPU path) a plain
softmax attention in torch ops instead, so that path calls no SDPA. There is no Triton encoder
kernel yet: the encoder runs once per image, eagerly, outside the decode hot path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shortconv.kernels.dispatch import resolve_backend


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor
) -> torch.Tensor:
    """q, k, v `[N, heads, L, d]`; key_mask bool `[N, 1, 1, L]` (True: attend) → `[N, heads, L,
    d]`. Scores and softmax in fp32, as transformers' eager attention."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~key_mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(q.dtype), v)


def encoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor
) -> torch.Tensor:
    """`softmax_attention`'s contract; SDPA on the torch path (see the module docstring)."""
    if resolve_backend(q.device) == "triton":
        return softmax_attention(q, k, v, key_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
