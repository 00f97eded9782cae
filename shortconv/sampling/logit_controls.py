"""Logit controls: logit_bias, min_tokens, repetition / frequency / presence penalties.

Applied by the sampler to the LM head's logits, outside any captured graph (as the grammar
mask is), batched over the rows: each control is a few full-batch ops on flat (row, token)
index tensors, so no row costs torch calls of its own. Rows that ask for nothing get identity
parameters (penalty 0 / 1, no entries) and are left unchanged.

The per-row token counts are rebuilt every step from the token ids the rows carry
(`SamplingRow.output_token_ids`, and `prompt_token_ids` for the repetition penalty): the
engine keeps no device-side history, so a preempted or resumed request needs no bookkeeping.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from shortconv.sampling.sampling_row import SamplingRow

_INT64 = torch.int64


def apply_logit_controls(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`logits` [B, V] with every row's controls applied, as a new fp32 tensor; the input
    itself when no row asks for any (the common case costs nothing), so the raw logits stay
    available for logprobs."""
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    banned = [(i, r.banned_token_ids) for i, r in enumerate(rows) if r.banned_token_ids]
    penalised = any(r.params.needs_output_counts for r in rows)
    if not (biased or banned or penalised):
        return logits
    x = logits.to(torch.float32, copy=True)
    if biased:
        where = _flat_index([(i, [t for t, _ in bias]) for i, bias in biased], x.device)
        values = [b for _, bias in biased for _, b in bias]
        x.index_put_(where, torch.tensor(values).to(x.device), accumulate=True)
    if banned:
        x.index_put_(_flat_index(banned, x.device), torch.tensor(float("-inf"), device=x.device))
    if penalised:
        x = _penalise(x, rows)
    return x


def _flat_index(
    lists: Sequence[tuple[int, Sequence[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row ids, token ids) of every (row, tokens) entry, flattened: two host->device copies
    whatever the batch (the row ids are expanded on the device from the per-row lengths)."""
    counts = torch.tensor([len(toks) for _, toks in lists], dtype=_INT64)
    row_ids = torch.tensor([i for i, _ in lists], dtype=_INT64)
    tokens = torch.tensor(list(itertools.chain.from_iterable(t for _, t in lists)), dtype=_INT64)
    rows = torch.repeat_interleave(row_ids.to(device), counts.to(device))
    return rows, tokens.to(device)


def _penalise(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (over prompt and output), then frequency and presence (over the output)."""
    batch, vocab = x.shape
    knobs = torch.tensor(
        [
            [r.params.presence_penalty, r.params.frequency_penalty, r.params.repetition_penalty]
            for r in rows
        ],
        dtype=torch.float32,
    ).to(x.device)
    presence, frequency, repetition = (knobs[:, j : j + 1] for j in range(3))
    outputs = [(i, r.output_token_ids) for i, r in enumerate(rows) if r.output_token_ids]
    counts = torch.zeros(batch, vocab, dtype=torch.float32, device=x.device)
    if outputs:
        where = _flat_index(outputs, x.device)
        counts.index_put_(where, torch.ones(where[0].shape[0], device=x.device), accumulate=True)
    seen = counts > 0
    prompts = [(i, r.prompt_token_ids) for i, r in enumerate(rows) if r.prompt_token_ids]
    if prompts:
        seen = seen.index_put(_flat_index(prompts, x.device), torch.tensor(True, device=x.device))
    # NOTE: rows with repetition_penalty 1 divide or multiply by exactly 1: unchanged.
    repeated = torch.where(x > 0, x / repetition, x * repetition)
    x = torch.where(seen, repeated, x)
    return x - frequency * counts - presence * (counts > 0).float()
