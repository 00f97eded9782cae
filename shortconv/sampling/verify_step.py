"""A step's sampling when some verify rows carry the draft's distribution q: those rows go
through rejection sampling (`sampling.verify.verify_draft`), every other row through the
usual sampler (n-gram and greedy-draft verify rows included: one draw per position)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import torch

from shortconv.sampling.sampler import Sampler, SamplerOutput, with_logprobs
from shortconv.sampling.sampling_row import SamplingRow
from shortconv.sampling.verify import verify_draft


@dataclass(frozen=True)
class DraftVerify:
    """One verify row with a draft distribution: the index of its first sampled row in the
    step, its k proposals and q [k, V] (the draft's probabilities at each)."""

    start: int
    draft: tuple[int, ...]
    q: torch.Tensor


def sample_step(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    verifies: Sequence[DraftVerify],
) -> SamplerOutput:
    """Tokens for every sampled row of logits [N, V]. A DraftVerify's k + 1 rows get its
    accepted proposals, then the one drawn token (the correction, or the bonus), repeated
    over the positions after it (the scheduler keeps the row up to the first token that
    differs from its proposal: `Speculator.accept`)."""
    if not verifies:
        return sampler(logits, rows)
    tokens: list[int] = [0] * len(rows)
    logprobs: list[float | None] = [None] * len(rows)
    tops: list[list[tuple[int, float]] | None] = [None] * len(rows)
    verified = [v.start + i for v in verifies for i in range(len(v.draft) + 1)]
    plain = sorted(set(range(len(rows))) - set(verified))
    if plain:
        out = sampler(_rows(logits, plain), [rows[i] for i in plain])
        _put(plain, out, tokens, logprobs, tops)
    by_k = sorted(verifies, key=lambda v: len(v.draft))
    for k, group in groupby(by_k, key=lambda v: len(v.draft)):
        _verify(k, list(group), logits, rows, tokens)
    _logprobs(logits, rows, verified, tokens, logprobs, tops)
    return SamplerOutput(tokens, logprobs, tops)


def _verify(
    k: int,
    group: list[DraftVerify],
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    tokens: list[int],
) -> None:
    """Rejection-sample the verify rows with k proposals, as one batch."""
    idx = [v.start + i for v in group for i in range(k + 1)]
    x = _rows(logits, idx).view(len(group), k + 1, -1)
    draft = torch.tensor([v.draft for v in group], dtype=torch.int64, device=x.device)
    q = torch.stack([v.q for v in group]).to(device=x.device, dtype=torch.float32)
    per = [rows[v.start : v.start + k + 1] for v in group]
    verdict = verify_draft(x, per, draft, q)
    kept, drawn = verdict.num_accepted.tolist(), verdict.token.tolist()
    for v, m, tok in zip(group, kept, drawn, strict=True):
        tokens[v.start : v.start + k + 1] = [*v.draft[:m], *([tok] * (k + 1 - m))]


def _logprobs(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    verified: list[int],
    tokens: list[int],
    logprobs: list[float | None],
    tops: list[list[tuple[int, float]] | None],
) -> None:
    """The raw model's logprobs of the verified rows' tokens, where their requests ask."""
    want = [rows[i].params.logprobs for i in verified]
    lp_rows = [j for j, w in enumerate(want) if w is not None]
    if not lp_rows:
        return
    x = _rows(logits, verified).float()
    chosen = torch.tensor([tokens[i] for i in verified], device=x.device)
    _put(verified, with_logprobs(x, chosen, want, lp_rows), tokens, logprobs, tops)


def _rows(logits: torch.Tensor, idx: list[int]) -> torch.Tensor:
    return logits.index_select(0, torch.tensor(idx, dtype=torch.int64, device=logits.device))


def _put(
    at: list[int],
    out: SamplerOutput,
    tokens: list[int],
    logprobs: list[float | None],
    tops: list[list[tuple[int, float]] | None],
) -> None:
    for j, i in enumerate(at):
        tokens[i], logprobs[i], tops[i] = out.token_ids[j], out.logprobs[j], out.top_logprobs[j]
