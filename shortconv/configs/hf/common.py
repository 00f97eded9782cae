"""Small readers shared by the per-architecture config mappers."""

from __future__ import annotations

from typing import Any


def eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def head_dim_of(c: Any) -> int:
    """`head_dim` when the config has one, else hidden_size // heads (as the modelling code)."""
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
