"""Applying allowed-token bitmasks to logits (torch only: runs on any device, no xgrammar).

A mask is xgrammar's layout: int32 words, bit `t % 32` of word `t // 32` set when token t is
allowed. Rows without a mask are left as they are, so one batch mixes grammars and no grammar.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_BITS = 32


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, vocab] bool (True = allowed); ids past the mask are refused
    (the model's vocab may be larger than the tokenizer's)."""
    shifts = torch.arange(_BITS, device=words.device, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts).bitwise_and_(1).bool()  # arithmetic shift: & 1 is exact
    allowed = bits.reshape(words.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(
        words.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=words.device
    )
    return torch.cat([allowed, pad], dim=1)


def apply_token_masks(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """`logits` [B, V] with refused tokens at -inf in the rows that carry a mask. Returns the
    input itself when no row has one (the common, unconstrained case costs nothing), else a
    copy: the raw logits stay available for logprobs."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    words = torch.stack([masks[i] for i in rows]).to(device=logits.device)  # type: ignore[misc]
    allowed = unpack_bitmask(words, logits.shape[-1])
    idx = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out
