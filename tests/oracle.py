"""Ground truth: transformers' greedy decode, with the near-tie rule (docs/architecture.md).

A divergence from the oracle is accepted only where the oracle's top-2 logit margin at that
position is below NEAR_TIE (fp32); the sequence is not compared past it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-4


@dataclass(frozen=True)
class OracleRun:
    tokens: list[int]
    margins: list[float]  # top1 - top2 logit at each generated position


@torch.inference_mode()
def oracle_greedy(hf_model: torch.nn.Module, prompt: list[int], max_new: int) -> OracleRun:
    """Greedy decode one unpadded prompt by full recomputation (no cache, no logits processors:
    EOS is just another token, like `ignore_eos=True`)."""
    seq = list(prompt)
    tokens, margins = [], []
    for _ in range(max_new):
        logits = hf_model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        top2 = torch.topk(logits, 2)
        tok = int(top2.indices[0])
        tokens.append(tok)
        margins.append(float(top2.values[0] - top2.values[1]))
        seq.append(tok)
    return OracleRun(tokens, margins)


def assert_matches_oracle(ours: list[int], ref: OracleRun, what: str = "") -> None:
    """Equal token-for-token, except past a near-tie of the oracle."""
    for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)):
        if a != b:
            assert ref.margins[i] < NEAR_TIE, (
                f"{what}: token {i} differs (ours {a}, oracle {b}) with oracle margin "
                f"{ref.margins[i]:.3g} >= {NEAR_TIE}\nours   {ours}\noracle {ref.tokens}"
            )
            return
    assert len(ours) == len(ref.tokens), f"{what}: length {len(ours)} != {len(ref.tokens)}"
