"""Applying allowed-token bitmasks to logits (torch only: runs on any device, no xgrammar).

A mask is xgrammar's layout: int32 words (native byte order, as bytes), bit `t % 32` of word
`t // 32` set when token t is allowed. Rows without a mask are left as they are, so one batch
mixes grammars and no grammar.
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


def apply_token_masks(logits: torch.Tensor, masks: Sequence[bytes | None]) -> torch.Tensor:
    """`logits` [B, V] with refused tokens at -inf in the rows that carry a mask. Returns the
    input itself when no row has one (the common, unconstrained case costs nothing), else a
    new tensor: the raw logits stay available for logprobs."""
    width = next((len(m) for m in masks if m is not None), None)
    if width is None:
        return logits
    # NOTE: a row without a mask gets an all-ones one, so the whole batch is masked in a few
    # full-batch ops (indexing rows out and back costs far more on CPU than masking them all).
    everything = b"\xff" * width
    flat = bytearray(b"".join(everything if m is None else m for m in masks))
    words = torch.frombuffer(flat, dtype=torch.int32).view(len(masks), -1).to(logits.device)
    allowed = unpack_bitmask(words, logits.shape[-1])
    return torch.where(allowed, logits, float("-inf"))
