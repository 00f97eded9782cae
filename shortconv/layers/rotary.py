"""NeoX-style rotary embedding: plain over the first `rotary_dim` channels of each head, or
proportional (LFM3's full attention: a full-head rotation whose last frequencies are zero)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shortconv.configs.config import RopeSpec


def inv_freq_of(head_dim: int, spec: RopeSpec) -> torch.Tensor:
    """Per-pair inverse frequencies (fp32), in the reference's arithmetic.

    Plain: rotary_dim/2 pairs, exponents over rotary_dim. Proportional: head_dim/2 pairs,
    exponents over head_dim, the last (head_dim - rotary_dim)/2 of them zero (not rotated)."""
    rd = spec.rotary_dim
    if not spec.proportional:
        return 1.0 / (spec.theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
    rotated = 1.0 / (spec.theta ** (torch.arange(0, rd, 2, dtype=torch.float) / head_dim))
    return torch.cat((rotated, torch.zeros((head_dim - rd) // 2, dtype=torch.float)))


class RotaryEmbedding(nn.Module):
    """cos/sin tables precomputed for every position; `forward` rotates q and k in place of copies.

    NOTE: the table entries are computed exactly as the reference does per call
    (fp32 `position * inv_freq`), so lookups are bit-identical to recomputation. `fp32` rotates
    in float32 and casts back (LFM3's reference); otherwise the tables are cast to q's dtype.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        theta: float,
        max_positions: int,
        proportional: bool = False,
        fp32: bool = False,
    ):
        super().__init__()
        inv_freq = inv_freq_of(head_dim, RopeSpec(theta, rotary_dim, proportional))
        self.rotary_dim = 2 * inv_freq.shape[0]  # proportional: the whole head turns
        self.fp32 = fp32
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if fp32:  # plain attributes: the model's dtype cast must not round them (see _apply)
            self.cos, self.sin = emb.cos(), emb.sin()
        else:
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> RotaryEmbedding:
        if self.fp32:  # NOTE: fp32 tables follow the model's device, never its dtype
            device = fn(torch.empty(0, device=self.cos.device)).device
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return super()._apply(fn, recurse)

    @staticmethod
    def of(head_dim: int, spec: RopeSpec, max_positions: int, fp32: bool) -> RotaryEmbedding:
        return RotaryEmbedding(
            head_dim, spec.rotary_dim, spec.theta, max_positions, spec.proportional, fp32
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, d], k: [T, Hk, d], positions: [T] int64."""
        dtype = torch.float32 if self.fp32 else q.dtype
        cos = self.cos[positions].to(dtype)[:, None, :]
        sin = self.sin[positions].to(dtype)[:, None, :]
        rd = self.rotary_dim
        q_out = _rotate(q.to(dtype), cos, sin, rd).to(q.dtype)
        return q_out, _rotate(k.to(dtype), cos, sin, rd).to(k.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> torch.Tensor:
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
