"""The draft model's sampler: draws its proposals and keeps the distribution q they came from.

A greedy request's draft proposes its argmax (a one-hot q, verified like n-gram proposals).
A request with temperature > 0 has its draft sample from q: the request's temperature,
top-k, top-p and min-p applied to the draft's own logits (not its penalties, `logit_bias`,
bans or grammar: q may be any distribution, the verify applies those to p), and q travels
with the verify row so rejection sampling can correct for it (`sampling.verify`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shortconv.sampling.sampler import Sampler, SamplerOutput, draw_seed, race, target_probs
from shortconv.sampling.sampling_row import SamplingRow

# Keeps the draft's stream apart from the target's one-token draws and from the verify's.
DRAFT_SALT = 0xBB67AE8584CAA73B


def draft_seed(seed: int, step: int) -> int:
    """The seed of a request's draft rows in the verify that starts at output length `step`;
    row i of it draws with (this, i). Each verify starts at a larger `step`, so no draw is
    reused: a reused draw would be correlated with the history it already shaped."""
    return draw_seed(seed ^ DRAFT_SALT, step)


class DraftSampler(Sampler):
    """Installed as the draft runner's sampler (one instance, bound at build). `last_probs`
    holds, per row of the last call, q [V] (normalised) or None for a greedy row."""

    def __init__(self) -> None:
        super().__init__()
        self.last_probs: list[torch.Tensor | None] = []

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        greedy = [r.params.greedy for r in rows]
        tokens = logits.argmax(dim=-1)
        self.last_probs = [None] * len(rows)
        rand = [i for i, g in enumerate(greedy) if not g]
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            q = target_probs(logits.index_select(0, idx).float(), [rows[i] for i in rand])
            q = q / q.sum(dim=-1, keepdim=True)
            tokens = tokens.index_copy(0, idx, race(q, [rows[i] for i in rand]))
            for j, i in enumerate(rand):
                self.last_probs[i] = q[j]
        n = len(rows)
        return SamplerOutput(tokens.tolist(), [None] * n, [None] * n)
