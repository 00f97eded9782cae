"""Token sampler: greedy, temperature, top-k / top-p / min-p, reproducible seeded draws; logit
controls (bias, min_tokens, penalties: shortconv/sampling/logit_controls.py) and grammar masks
first.

Filtering is vectorised over the batch with per-row parameter tensors; the only per-row work is
seeding a generator and drawing that row's exponential noise. Every call ends in exactly one
device->host transfer, so the sampler never adds syncs beyond the one the engine must pay anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shortconv.sampling.grammar.token_mask import apply_token_masks
from shortconv.sampling.logit_controls import apply_logit_controls
from shortconv.sampling.sampling_row import SamplingRow

_M64 = (1 << 64) - 1
_M63 = (1 << 63) - 1
_FORK_SALT = 0x6A09E667F3BCC909  # keeps fork seeds apart from draw_seed's (seed, step) mixing
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplerOutput:
    """Per-row results, in row order. Logprobs are of the raw (unscaled, unfiltered) model
    distribution; `logprobs[i]` is set iff rows[i].params.logprobs is not None, and
    `top_logprobs[i]` (most likely first) iff it is > 0."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def draw_seed(seed: int, step: int) -> int:
    """The generator seed for (request seed, step).

    Two full splitmix64 rounds so nearby (seed, step) pairs give unrelated streams (seed s at
    step t must not collide with seed s+1 at step t-1, as a plain sum would). Masked to 63
    bits so it is a valid non-negative seed for every torch generator. Any int is accepted
    (negative or huge seeds are taken mod 2**64).
    """
    return _splitmix64(_splitmix64(seed & _M64) ^ (step & _M64)) & _M63


def fork_seed(seed: int, index: int) -> int:
    """The seed of fork `index` of a request seeded `seed` (`SamplingParams.n` > 1).

    Fork 0 keeps the request's seed, so it draws what the same request with n=1 would; the
    others get unrelated streams (the index goes through splitmix64 before it meets the seed,
    so fork i's seed is no request's seed plus a small step).
    """
    if index == 0:
        return seed
    return _splitmix64((seed & _M64) ^ _splitmix64(_FORK_SALT ^ index)) & _M63


class Sampler:
    """Picks one token per row of a [B, V] logits tensor. Stateless and thread-compatible."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"Sampler: logits must be [len(rows), V], got {tuple(logits.shape)} for "
                f"{len(rows)} rows"
            )
        batch = len(rows)
        if batch == 0:
            return SamplerOutput([], [], [])
        want = [r.params.logprobs for r in rows]
        greedy = [r.params.greedy for r in rows]
        # Controls and grammar masks change what is picked; logprobs stay the raw model's.
        controlled = apply_logit_controls(logits, rows)
        masked = apply_token_masks(controlled, [r.token_mask for r in rows])
        if all(greedy) and all(k is None for k in want):
            # Decode fast path: argmax on the raw dtype orders exactly like fp32 (the widening
            # is exact and monotone), so skip the [B, V] fp32 copy.
            return SamplerOutput(masked.argmax(dim=-1).tolist(), [None] * batch, [None] * batch)

        x = masked.float()
        rand = [i for i, g in enumerate(greedy) if not g]
        if len(rand) == batch:
            tokens = _sample(x, rows)
        else:
            # First-index argmax breaks greedy ties deterministically.
            tokens = x.argmax(dim=-1)
            if rand:
                idx = torch.tensor(rand, device=x.device)
                picked = _sample(x.index_select(0, idx), [rows[i] for i in rand])
                tokens = tokens.index_copy(0, idx, picked)

        lp_rows = [i for i, k in enumerate(want) if k is not None]
        if not lp_rows:
            return SamplerOutput(tokens.tolist(), [None] * batch, [None] * batch)
        raw = x if masked is logits else logits.float()
        return with_logprobs(raw, tokens, want, lp_rows)


def _sample(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Draw one token per row of fp32 logits `x` [R, V] (all rows non-greedy); returns [R]."""
    return race(target_probs(x, rows), rows)


def race(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One seeded draw per row of `probs` [R, V] (unnormalised is fine); returns [R]."""
    # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability
    # p_i / sum(p). Noise depends only on (seed, step, V), never on batch position, so a
    # request reproduces its tokens after preemption or on another replica. One generator is
    # reseeded per row; manual_seed resets its state fully, so this equals a fresh one per row.
    noise = torch.empty_like(probs)
    gen = torch.Generator(device=probs.device)
    for i, row in enumerate(rows):
        gen.manual_seed(draw_seed(row.seed, row.step))
        noise[i].exponential_(generator=gen)
    # A zero draw would make 0/0 = NaN win argmax on a filtered token; clamping keeps filtered
    # tokens at exactly 0 while the kept top token stays > 0.
    return (probs / noise.clamp_min_(_TINY)).argmax(dim=-1)


def target_probs(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution each row of fp32 logits `x` [R, V] is sampled from (controls and
    masks already applied): temperature, then top-k / top-p / min-p zeroed out. [R, V], NOT
    renormalised after the cut (the race does not need it; rejection sampling divides)."""
    num, vocab = x.shape
    params = [r.params for r in rows]
    use_k = any(0 < p.top_k < vocab for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0.0 for p in params)
    # One host->device copy for all per-row knobs. k = V disables top-k; float32 holds every
    # k exactly because vocabularies are far below 2**24.
    cfg = torch.tensor(
        [
            [p.temperature, p.top_k if 0 < p.top_k < vocab else vocab, p.top_p, p.min_p]
            for p in params
        ],
        dtype=torch.float32,
    ).to(device=x.device)
    temp, top_k, top_p, min_p = (cfg[:, j : j + 1] for j in range(4))

    # Subtract the row max before dividing: the max becomes exactly 0 and everything else <= 0,
    # so a tiny temperature drives the rest to -inf instead of overflowing into inf - inf = NaN.
    # The clamp covers temperatures that underflow float32.
    scaled = (x - x.amax(dim=-1, keepdim=True)) / temp.clamp_min(_TINY)

    drop: torch.Tensor | None = None
    if use_k or use_p:
        # Stable sort so equal logits are cut at the same place on every run.
        sorted_vals, order = scaled.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=x.device, dtype=torch.float32)
        drop_sorted = rank.unsqueeze(0) >= top_k
        if use_p:
            # Nucleus over the top-k-truncated, renormalised distribution (HF / vLLM order).
            p_sorted = sorted_vals.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)
            # Keep a token while the mass strictly before it is < top_p: the smallest prefix
            # reaching top_p. The top token has mass-before exactly 0 < top_p, so it always stays.
            mass_before = p_sorted.cumsum(dim=-1) - p_sorted
            drop_sorted = drop_sorted | (mass_before >= top_p)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)

    probs = scaled.softmax(dim=-1)
    if use_min_p:
        # The max-prob token is never truncated by top-k/top-p, so the ratio is the same before
        # or after their renormalisation, and the top token (ratio 1 >= min_p) always survives.
        low = probs < min_p * probs.amax(dim=-1, keepdim=True)
        drop = low if drop is None else drop | low
    if drop is not None:
        # No renormalisation needed: the race is invariant to scaling a row.
        probs = probs.masked_fill(drop, 0.0)
    return probs


def with_logprobs(
    x: torch.Tensor, tokens: torch.Tensor, want: list[int | None], lp_rows: list[int]
) -> SamplerOutput:
    """Attach raw-distribution logprobs, packing everything into one tensor for one transfer."""
    batch, vocab = x.shape
    device = x.device
    idx = torch.tensor(lp_rows, device=device)
    lsm = torch.log_softmax(x.index_select(0, idx), dim=-1)
    chosen = lsm.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1)
    kmax = min(max(want[i] or 0 for i in lp_rows), vocab)
    # float64 holds token ids (< 2**53) and fp32 logprobs exactly, so one dtype carries all.
    parts = [tokens.double(), chosen.double()]
    if kmax > 0:
        top_vals, top_ids = lsm.topk(kmax, dim=-1)  # sorted, most likely first
        parts += [top_vals.double().flatten(), top_ids.double().flatten()]
    flat = torch.cat(parts).tolist()

    token_ids = [int(t) for t in flat[:batch]]
    logprobs: list[float | None] = [None] * batch
    top: list[list[tuple[int, float]] | None] = [None] * batch
    n = len(lp_rows)
    vals_at, ids_at = batch + n, batch + n + n * kmax
    for j, i in enumerate(lp_rows):
        logprobs[i] = flat[batch + j]
        k = min(want[i] or 0, vocab)
        if k > 0:
            vals = flat[vals_at + j * kmax : vals_at + j * kmax + k]
            ids = flat[ids_at + j * kmax : ids_at + j * kmax + k]
            top[i] = [(int(t), v) for t, v in zip(ids, vals, strict=True)]
    return SamplerOutput(token_ids, logprobs, top)
