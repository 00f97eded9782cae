"""KV layer groups: which attention layers share one page table, derived once from ModelConfig.

A group is the attention layers that see the same window. Group 0 is always the full-attention
group (every "attention" and "cca" layer; possibly no layer at all, for a model whose attention
is all sliding); then one group per distinct sliding window, smallest window first. Each group
has its own KV tensors in the `StatePool`, its own `PageAllocator` and its own page list per
request, so a sliding group's pages can go back to its pool once they leave every window while
the full group keeps everything (docs/kv_memory.md says why the pool is split this way).

LFM2, LFM2-MoE and ZAYA1 have one group; the single-group path is the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shortconv.cache.state_pool import KVSpec
from shortconv.configs.config import ModelConfig
from shortconv.execution.head_shard import head_shard
from shortconv.execution.parallel import ParallelContext


@dataclass(frozen=True)
class KVGroup:
    """Attention layers with one window (0: the whole context)."""

    window: int
    layer_ids: tuple[int, ...]


def kv_groups(cfg: ModelConfig) -> tuple[KVGroup, ...]:
    """The model's KV groups: the full group first, then one per sliding window."""
    by_window: dict[int, list[int]] = {0: []}
    for lid in cfg.attention_layer_ids:
        by_window.setdefault(cfg.window_of(lid), []).append(lid)
    return tuple(KVGroup(w, tuple(by_window[w])) for w in sorted(by_window))


def kv_specs(
    cfg: ModelConfig, tp: ParallelContext, page_size: int, num_pages: Sequence[int] | int
) -> tuple[KVSpec, ...]:
    """One rank's KV spec per group (`num_pages`: per group, or one count for all)."""
    groups = kv_groups(cfg)
    counts = [num_pages] * len(groups) if isinstance(num_pages, int) else list(num_pages)
    if len(counts) != len(groups):
        raise ValueError(f"{len(groups)} KV groups, got page counts for {len(counts)}")
    hk = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank).num_kv
    return tuple(
        KVSpec(g.layer_ids, hk, cfg.head_dim, page_size, n, g.window)
        for g, n in zip(groups, counts, strict=True)
    )


def window_page_bound(window: int, page_size: int) -> int:
    """The most pages a request keeps in a sliding group between steps: the w positions a
    decode row sees may straddle one more page than they fill."""
    return -(-window // page_size) + 1


def first_live_page(start: int, window: int, page_size: int) -> int:
    """The first logical page a chunk starting at `start` still reads in a group of `window`
    (0: the full group reads them all). Pages before it are wholly before `start - w + 1`."""
    if window <= 0:
        return 0
    return max(0, start - window + 1) // page_size
