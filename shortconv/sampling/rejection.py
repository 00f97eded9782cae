"""Rejection sampling for speculative decoding: keep a draft's proposals so that the emitted
tokens follow the target's distribution whatever the draft proposed.

Proposal i (drawn by the draft from q_i) is accepted with probability min(1, p_i(x) / q_i(x));
the first rejected position instead emits a draw from the normalised residual
max(0, p_i - q_i); if every proposal is accepted, the bonus token is drawn from p_k. Emitted
token j then has exactly the law p_j (Leviathan et al. 2023, Chen et al. 2023).

`rejection_sample` is pure: the randomness comes in as tensors, so a test can drive it and the
engine can seed it per request (`seeded_draws`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shortconv.sampling.sampler import draw_seed

_TINY = torch.finfo(torch.float32).tiny
# Keeps the verify stream apart from the one-token-a-step stream of the same (seed, step).
_VERIFY_SALT = 0x3C6EF372FE94F82B


@dataclass(frozen=True)
class Verdict:
    """Per row: `num_accepted` [R] proposals kept, then `token` [R], the one drawn token
    (the correction at the first rejected position, or the bonus after all k)."""

    num_accepted: torch.Tensor
    token: torch.Tensor


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> Verdict:
    """p [R, k + 1, V]: the target's probabilities at the verify positions (each row summing
    to 1). q [R, k, V]: the draft's at its k proposals, or None for one-hot proposals (n-gram).
    draft [R, k] int64: the proposed ids. uniforms [R, k] in [0, 1): the accept draws.
    noise [R, k + 1, V] > 0, Exp(1): the exponential race that draws the emitted token."""
    rows, k1, _ = p.shape
    k = k1 - 1
    idx = draft.unsqueeze(-1)
    p_draft = p[:, :k].gather(-1, idx).squeeze(-1)
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, idx).squeeze(-1)
    # u < p / q without dividing: a proposal with p = 0 is never kept, one with q = 0 always.
    accept = uniforms * q_draft < p_draft
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)
    at = torch.arange(rows, device=p.device)
    p_at = p[at, num_accepted]
    residual = p_at - _draft_probs_at(q, draft, num_accepted, p_at)
    residual = residual.clamp_min(0.0)
    # NOTE: p == q makes the residual all zero, but then rejection has probability 0; the
    # fallback to p only guards rounding.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_at, residual)
    # The race needs no normalisation: argmax r_i / E_i picks i with probability r_i / sum(r).
    token = (residual / noise[at, num_accepted].clamp_min(_TINY)).argmax(dim=-1)
    return Verdict(num_accepted, token)


def _draft_probs_at(
    q: torch.Tensor | None, draft: torch.Tensor, num_accepted: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """q at each row's first rejected position; zeros where all k were accepted (the bonus
    is drawn from p itself). One-hot at the proposed id when q is None."""
    rows, k = draft.shape
    rejected = num_accepted < k
    pos = num_accepted.clamp_max(max(k - 1, 0))
    at = torch.arange(rows, device=like.device)
    if k == 0:
        return torch.zeros_like(like)
    if q is None:
        q_at = torch.zeros_like(like).scatter(-1, draft[at, pos].unsqueeze(-1), 1.0)
    else:
        q_at = q[at, pos]
    return q_at * rejected.unsqueeze(-1).to(like.dtype)


def seeded_draws(
    seeds: Sequence[tuple[int, int]], k: int, vocab: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniforms [R, k], noise [R, k + 1, vocab]) for rows given as (request seed, step):
    the same (seed, step) always gives the same draws, wherever the row sits in the batch."""
    uniforms = torch.empty(len(seeds), k, device=device)
    noise = torch.empty(len(seeds), k + 1, vocab, device=device)
    gen = torch.Generator(device=device)
    for i, (seed, step) in enumerate(seeds):
        gen.manual_seed(draw_seed(seed ^ _VERIFY_SALT, step))
        uniforms[i].uniform_(generator=gen)
        noise[i].exponential_(generator=gen)
    return uniforms, noise
