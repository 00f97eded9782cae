"""Which attention heads a tensor-parallel rank holds: query heads split, KV heads split or
replicated.

Query heads are always split evenly and contiguously (rank r holds heads
[r*Hq/tp, (r+1)*Hq/tp)). KV heads follow the query heads that use them (query head j uses KV
head j // (Hq/Hk), as in transformers' `repeat_kv`):
  * tp <= Hk: each rank holds a contiguous block of Hk/tp KV heads (partitioned);
  * tp > Hk: each KV head is held by tp/Hk ranks (replicated), every rank holding the one KV
    head its query heads share, loaded from the checkpoint, not recomputed from a split.
Anything else would leave a rank's query heads spread over KV heads it does not hold, and is
refused with the dimension named.
"""

from __future__ import annotations

from dataclasses import dataclass

from shortconv.errors import ConfigError

HEADS = "attention heads (num_attention_heads)"
KV_HEADS = "KV heads (num_key_value_heads)"


@dataclass(frozen=True)
class HeadShard:
    """One rank's query heads [q_start, q_start+num_q) and KV heads [kv_start, kv_start+num_kv).

    `replicas` ranks hold each KV head (1: partitioned). `groups` is the model's query heads per
    KV head, so the rank's KV heads serve query heads [group_q_start, +num_kv*groups): all of
    them the rank's own when partitioned, a superset when replicated."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    num_q: int
    kv_start: int
    num_kv: int
    replicas: int

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def group_q_start(self) -> int:
        return self.kv_start * self.groups

    def kv_rows(self, head_dim: int) -> tuple[tuple[int, int], ...]:
        """The rows of a KV projection ([Hk*head_dim, ...]) this rank holds."""
        return ((self.kv_start * head_dim, (self.kv_start + self.num_kv) * head_dim),)


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int = 0) -> HeadShard:
    """Rank `rank`'s heads at `tp_size`; ConfigError naming the dimension that cannot split."""
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ConfigError(
            f"num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    if num_heads % tp_size:
        raise ConfigError(f"tp_size={tp_size} does not divide {HEADS} = {num_heads}")
    partitioned = tp_size <= num_kv_heads
    if num_kv_heads % tp_size if partitioned else tp_size % num_kv_heads:
        raise ConfigError(
            f"tp_size={tp_size} does not divide {KV_HEADS} = {num_kv_heads}, nor is it a "
            "multiple of it: a rank's query heads would need KV heads held by other ranks"
        )
    num_q = num_heads // tp_size
    if partitioned:
        num_kv, replicas = num_kv_heads // tp_size, 1
    else:
        num_kv, replicas = 1, tp_size // num_kv_heads
    return HeadShard(
        num_heads, num_kv_heads, rank * num_q, num_q, rank // replicas * num_kv, num_kv, replicas
    )
