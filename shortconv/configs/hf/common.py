"""Small readers shared by the per-architecture config mappers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def head_dim_of(c: Any) -> int:
    """`head_dim` when the config has one, else hidden_size // heads (as the modelling code)."""
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


@dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding of one kind of attention layer.

    `rotary_dim` channels rotate. Plain (NeoX) RoPE rotates the first `rotary_dim` channels of a
    head with frequencies over `rotary_dim`; `proportional` RoPE (LFM3's full attention) keeps
    the frequencies of a full-head rotation (exponents over head_dim) for the first
    `rotary_dim / 2` pairs and zero for the rest, rotating pairs (i, i + head_dim / 2)."""

    theta: float
    rotary_dim: int
    proportional: bool = False
