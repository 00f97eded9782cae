"""One row of the sampler's batch: a request's parameters and what its next token depends on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shortconv.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One row of the logits batch and how to pick its next token."""

    params: SamplingParams
    seed: int  # effective per-request seed, chosen by the engine
    step: int  # tokens this request has generated so far (0 for the first)
    # Allowed next tokens of a grammar-constrained request: xgrammar's int32 bitmask, as bytes.
    token_mask: bytes | None = field(default=None, compare=False)
    # The request's tokens, carried only when its penalties need them (`make_row`).
    prompt_token_ids: tuple[int, ...] = field(default=(), compare=False)
    output_token_ids: tuple[int, ...] = field(default=(), compare=False)
    # Tokens refused at this step: EOS and stop ids while fewer than min_tokens are generated.
    banned_token_ids: tuple[int, ...] = ()


def make_row(
    params: SamplingParams,
    seed: int,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_token_ids: Sequence[int],
    token_mask: bytes | None = None,
) -> SamplingRow:
    """The row for a request's next token: its history only where its controls read it (the
    plan crosses to every TP rank each step, so plain rows stay small); `token_mask`: its
    grammar's allowed tokens (`engine.step_rows`)."""
    banned: tuple[int, ...] = ()
    if len(output) < params.min_tokens:
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        banned = tuple(sorted(set(eos) | set(params.stop_token_ids)))
    return SamplingRow(
        params,
        seed,
        len(output),
        token_mask=token_mask,
        prompt_token_ids=tuple(prompt) if params.needs_prompt_tokens else (),
        output_token_ids=tuple(output) if params.needs_output_counts else (),
        banned_token_ids=banned,
    )
