"""Small readers shared by the per-architecture config mappers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shortconv.errors import ConfigError


def eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def map_layer_types(
    types: list[str], num_layers: int, ours: dict[str, str], family: str
) -> tuple[str, ...]:
    """transformers' layer_types → our kinds through `ours`; refuses a wrong count or kind."""
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted({t for t in types if t not in ours})
    if unknown:
        raise ConfigError(
            f"unknown {family} layer types {unknown}; expected {', '.join(sorted(ours))}"
        )
    return tuple(ours[t] for t in types)


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
