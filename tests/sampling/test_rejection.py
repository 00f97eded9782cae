"""Rejection sampling (speculative decoding with a draft distribution): emitted tokens follow
the target's p, checked by a chi-square test; seeded draws reproduce; controls apply to p."""

from __future__ import annotations

from typing import Any

import torch

from shortconv.sampling.rejection import rejection_sample, seeded_draws
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.sampling.sampling_row import SamplingRow
from shortconv.sampling.verify import verify_draft

N = 50_000
# Target and draft over 6 tokens, per position: q puts its mass where p does not, so about
# half the proposals are rejected and the residual max(0, p - q) differs from p.
P = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
        [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
        [0.40, 0.05, 0.05, 0.10, 0.20, 0.20],
    ]
)
Q = torch.tensor(
    [
        [0.05, 0.10, 0.10, 0.20, 0.25, 0.30],
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    ]
)
ALPHA = 1e-4  # fixed seeds make the outcome deterministic; this only sets the strictness


def _chi2_pvalue(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test of `samples` (token ids) against the law `expected`."""
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    exp = expected.double() * counts.sum()
    stat = ((counts - exp) ** 2 / exp).sum()
    df = expected.numel() - 1
    # P(chi2_df > stat) = Q(df / 2, stat / 2), the regularised upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def _draw() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N verify rows: proposals drawn from Q, then rejection-sampled against P. Returns the
    draft [N, 2], the accepted count [N] and the drawn token [N]."""
    gen = torch.Generator().manual_seed(1234)
    draft = torch.stack([torch.multinomial(Q[i], N, True, generator=gen) for i in range(2)], 1)
    uniforms = torch.rand(N, 2, generator=gen)
    noise = torch.empty(N, 3, 6).exponential_(generator=gen)
    p = P.expand(N, -1, -1)
    q = Q.expand(N, -1, -1)
    v = rejection_sample(p, q, draft, uniforms, noise)
    return draft, v.num_accepted, v.token


def _emitted(draft: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor, pos: int):
    """Token emitted at `pos` by rows that reached it (accepted at least `pos` proposals)."""
    reached = accepted >= pos
    kept = accepted > pos
    return torch.where(kept, draft[:, pos], token)[reached]


def test_first_token_follows_target() -> None:
    draft, accepted, token = _draw()
    first = _emitted(draft, accepted, token, 0)
    assert first.numel() == N
    assert _chi2_pvalue(first, P[0]) > ALPHA
    # Not vacuous: the draft alone is far from p, and rejections happen.
    assert _chi2_pvalue(draft[:, 0], P[0]) < ALPHA
    assert 0.2 < (accepted == 0).double().mean() < 0.8


def test_second_token_follows_target_given_acceptance() -> None:
    draft, accepted, token = _draw()
    second = _emitted(draft, accepted, token, 1)
    assert second.numel() >= 20_000
    assert _chi2_pvalue(second, P[1]) > ALPHA


def test_bonus_follows_target_after_full_acceptance() -> None:
    draft, accepted, token = _draw()
    bonus = token[accepted == 2]
    assert bonus.numel() > 1000
    assert _chi2_pvalue(bonus, P[2]) > ALPHA


def test_one_hot_draft_when_q_is_absent() -> None:
    """q = None is a one-hot draft: accept x with probability p(x), else draw from p without x."""
    gen = torch.Generator().manual_seed(5)
    draft = torch.full((N, 1), 0, dtype=torch.int64)
    v = rejection_sample(
        P[:2].expand(N, -1, -1),
        None,
        draft,
        torch.rand(N, 1, generator=gen),
        torch.empty(N, 2, 6).exponential_(generator=gen),
    )
    assert abs(float((v.num_accepted == 1).double().mean()) - 0.30) < 0.01
    assert not bool((v.token[v.num_accepted == 0] == 0).any())  # the residual excludes x
    assert _chi2_pvalue(_emitted(draft, v.num_accepted, v.token, 0), P[0]) > ALPHA


def _rows(seed: int, step: int, k: int, **kw: Any) -> list[SamplingRow]:
    params = SamplingParams(**kw)
    return [SamplingRow(params, seed, step + i) for i in range(k + 1)]


def test_seeded_draws_reproduce() -> None:
    logits = torch.randn(64, 3, 50, generator=torch.Generator().manual_seed(0))
    draft = torch.randint(0, 50, (64, 2), generator=torch.Generator().manual_seed(1))
    q = torch.softmax(torch.randn(64, 2, 50, generator=torch.Generator().manual_seed(2)), -1)
    rows = [_rows(seed=r, step=3, k=2, temperature=1.0) for r in range(64)]
    a, b = (verify_draft(logits, rows, draft, q) for _ in range(2))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.token, b.token)
    other = [_rows(seed=r + 1000, step=3, k=2, temperature=1.0) for r in range(64)]
    c = verify_draft(logits, other, draft, q)
    assert not torch.equal(a.token, c.token)
    # A row's draws depend on its (seed, step) only, not on its place in the batch.
    u1, n1 = seeded_draws([(7, 3)], 2, 50)
    u2, n2 = seeded_draws([(1, 1), (7, 3)], 2, 50)
    assert torch.equal(u1[0], u2[1]) and torch.equal(n1[0], n2[1])


def test_greedy_accepts_while_argmax() -> None:
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]])
    q = torch.full((1, 2, 3), 1 / 3)
    rows = [_rows(seed=0, step=0, k=2, temperature=0.0)]
    v = verify_draft(logits, rows, torch.tensor([[1, 0]]), q)
    assert (int(v.num_accepted), int(v.token)) == (2, 2)  # both argmax, bonus = argmax
    v = verify_draft(logits, rows, torch.tensor([[1, 2]]), q)
    assert (int(v.num_accepted), int(v.token)) == (1, 0)  # corrected to the argmax


def test_logit_bias_applies_at_every_position() -> None:
    """A token biased away is never kept nor drawn, at any verified position."""
    logits = torch.zeros(512, 3, 4)
    draft = torch.full((512, 2), 3, dtype=torch.int64)
    q = torch.zeros(512, 2, 4)
    q[..., 3] = 1.0
    rows = [_rows(r, 0, 2, temperature=1.0, logit_bias={3: -100.0}) for r in range(512)]
    v = verify_draft(logits, rows, draft, q)
    assert int(v.num_accepted.max()) == 0
    assert not bool((v.token == 3).any())
