"""Where each TP rank's state shard sits in the unsharded layout a state bundle carries.

A bundle's tensors are always in the tp_size 1 layout, so a session exported at one TP degree
imports at any other: export gathers every rank's shard into one tensor, import cuts each
rank's shard back out. Every bundle tensor is sharded along dim 2 (`[layers, checkpoints,
channels, ...]` for a state kind, `[layers, tokens, Hk, d]` for KV), and a rank holds a few
row ranges of it: a contiguous block of short-conv channels, ZAYA1's own query channels plus
its KV heads' key channels (`layers.cca.qk_rows`), its KV heads (replicated when tp > Hk: two
ranks then hold the same rows, which gather writes twice with equal values).

The row ranges come from the model class (`state_rows`, next to `state_specs`) and the head
split (`execution.head_shard`), computed once when the executor is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shortconv.cache.kv_groups import kv_groups
from shortconv.configs.config import ModelConfig
from shortconv.execution.head_shard import head_shard
from shortconv.execution.parallel import ParallelContext
from shortconv.execution.shard_rows import Rows
from shortconv.models.registry import model_class

_DIM = 2


@dataclass(frozen=True)
class StateShards:
    """Per rank, the rows of every bundle tensor it holds; `sizes`: the unsharded dim 2."""

    rows: tuple[Mapping[str, Rows], ...]
    sizes: Mapping[str, int]

    def gather(self, per_rank: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One unsharded tensor per name from every rank's `gather_state` output."""
        out: dict[str, torch.Tensor] = {}
        for name, first in per_rank[0].items():
            shape = list(first.shape)
            shape[_DIM] = self.sizes[name]
            full = first.new_empty(shape)
            for rows, part in zip(self.rows, per_rank, strict=True):
                offset = 0
                for lo, hi in rows[name]:
                    full[:, :, lo:hi] = part[name][:, :, offset : offset + hi - lo]
                    offset += hi - lo
            out[name] = full
        return out

    def scatter(self, tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Each rank's shard of unsharded `tensors`; ValueError when a name is unknown or its
        dim 2 is not the unsharded size (the ranks check every other dim before writing)."""
        for name, t in tensors.items():
            if name not in self.sizes:
                raise ValueError(f"state kind {name!r} is not one of {sorted(self.sizes)}")
            if t.dim() <= _DIM or t.shape[_DIM] != self.sizes[name]:
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)}, dim 2 must be {self.sizes[name]}"
                )
        return [
            {
                name: torch.cat([t[:, :, lo:hi] for lo, hi in rows[name]], dim=_DIM)
                for name, t in tensors.items()
            }
            for rows in self.rows
        ]


def state_shards(cfg: ModelConfig, tp_size: int) -> StateShards:
    """The shard map of `cfg`'s state at `tp_size` (rank 0's rows at tp 1 give the sizes)."""
    ranks = tuple(_rank_rows(cfg, ParallelContext(r, tp_size)) for r in range(tp_size))
    whole = _rank_rows(cfg, ParallelContext(0, 1))
    sizes = {name: max(hi for _, hi in rows) for name, rows in whole.items()}
    return StateShards(ranks, sizes)


def _rank_rows(cfg: ModelConfig, tp: ParallelContext) -> dict[str, Rows]:
    rows = dict(model_class(cfg.arch).state_rows(cfg, tp))
    heads = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank)
    kv = ((heads.kv_start, heads.kv_start + heads.num_kv),)
    for g in range(len(kv_groups(cfg))):
        rows[f"kv{g}.k"] = rows[f"kv{g}.v"] = kv
    return rows
