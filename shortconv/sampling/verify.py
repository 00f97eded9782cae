"""Verifying a draft model's proposals: the target's logits at k + 1 positions, through the same
controls and filters the sampler applies, then rejection sampling against the draft's q.

Used where proposals come with a distribution (`draft_model`). n-gram proposals are verified
by the per-position draws of `engine.speculation` instead: with a one-hot q that is the same
law, and it keeps a seeded request's tokens identical with speculation on or off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shortconv.sampling.grammar.token_mask import apply_token_masks
from shortconv.sampling.logit_controls import apply_logit_controls
from shortconv.sampling.rejection import Verdict, rejection_sample, seeded_draws
from shortconv.sampling.sampler import target_probs
from shortconv.sampling.sampling_row import SamplingRow


def verify_draft(
    logits: torch.Tensor,
    rows: Sequence[Sequence[SamplingRow]],
    draft: torch.Tensor,
    q: torch.Tensor | None,
) -> Verdict:
    """logits [R, k + 1, V]: the target's, per verify row; rows[r][i]: the sampling row of
    position i of row r (`make_row` with the first i proposals taken as generated, so
    penalties, logit_bias and min_tokens bans apply to p at every position); draft [R, k];
    q [R, k, V] or None (one-hot). Greedy rows accept while the argmax equals the proposal."""
    num, k1, vocab = logits.shape
    flat = [r for per in rows for r in per]
    if len(flat) != num * k1:
        raise ValueError(f"verify_draft: {len(flat)} sampling rows for logits {logits.shape}")
    x = apply_logit_controls(logits.reshape(num * k1, vocab), flat)
    x = apply_token_masks(x, [r.token_mask for r in flat]).float()
    p = _probs(x, flat).view(num, k1, vocab)
    uniforms, noise = seeded_draws([(per[0].seed, per[0].step) for per in rows], k1 - 1, vocab)
    return rejection_sample(p, q, draft, uniforms.to(p.device), noise.to(p.device))


def _probs(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Normalised target probabilities; a greedy row's is one-hot at its argmax, which makes
    rejection sampling accept exactly while the proposal is the argmax, and correct to it."""
    greedy = torch.tensor([r.params.greedy for r in rows], device=x.device)
    onehot = torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    if bool(greedy.all()):
        return onehot
    p = target_probs(x, rows)
    p = p / p.sum(dim=-1, keepdim=True)
    return torch.where(greedy.unsqueeze(-1), onehot, p)
