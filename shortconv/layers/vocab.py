"""Vocab-parallel embedding and LM head (each rank holds vocab/tp rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shortconv.execution.parallel import ParallelContext
from shortconv.layers.linear import LinearBase, mark_shard


class VocabEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, tp: ParallelContext):
        super().__init__()
        self.tp = tp
        self.rows = tp.shard(vocab, "vocab_size")
        self.start = tp.rank * self.rows
        self.weight = mark_shard(nn.Parameter(torch.empty(self.rows, hidden)), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class LMHead(LinearBase):
    """logits = h W^T (+ b), gathered to the full vocab; `weight` may be the embedding's."""

    is_lm_head = True

    def __init__(self, vocab: int, hidden: int, tp: ParallelContext, bias: bool = False):
        super().__init__()
        self.tp = tp
        rows = tp.shard(vocab, "vocab_size")
        self.weight = mark_shard(nn.Parameter(torch.empty(rows, hidden)), 0)
        self.bias = mark_shard(nn.Parameter(torch.empty(rows)), 0) if bias else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.method.apply(self, h, self.bias))
