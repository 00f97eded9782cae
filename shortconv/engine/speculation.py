"""Speculative decoding on the scheduler's side: what a request proposes, and what it accepts.

A speculating request's decode row becomes a verify row: its last token then k proposed
tokens (n-gram lookup, `engine.ngram`), k + 1 positions scored in one forward. Each position
is sampled with the row the request would have had there had the proposals before it been
accepted (its step, so its seeded draw, and its penalty history), and a proposal is accepted
while it equals the token drawn at its position; the first draw that differs (or the draw
after the last proposal) is the step's last token. With one-hot proposals this is exactly
rejection sampling, so greedy and seeded sampling alike give what decoding one token a step
gives (docs/speculative_decoding.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shortconv.configs.speculative import SpeculativeConfig
from shortconv.engine.ngram import propose_ngram
from shortconv.engine.request import Request
from shortconv.engine.spec_policy import observe, request_allows, step_allows


@dataclass
class SpecCounters:
    """Since start-up: verify rows run, tokens proposed in them, proposals accepted; and by
    position (`accepted_per_pos[i]`: rows that kept proposal i) and by run length
    (`accepted_lengths[n]`: rows that kept exactly n proposals)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)


class Speculator:
    """Proposals and acceptance for one scheduler: its counters, and each request's
    acceptance tracker (on the request) for the switch-off policy (`engine.spec_policy`)."""

    def __init__(self, cfg: SpeculativeConfig | None) -> None:
        self.cfg = cfg
        k = cfg.num_speculative_tokens if cfg is not None else 0
        self.counters = SpecCounters(accepted_per_pos=[0] * k, accepted_lengths=[0] * (k + 1))

    def limit(self, req: Request, room: int, max_model_len: int, num_running: int = 1) -> int:
        """The most tokens req may propose this step: k, within `room` budget tokens beyond its
        own, the positions left before `max_model_len`, and `max_tokens` (a verify row adds at
        most k + 1 tokens); 0 for a request that does not speculate, in a step of more than
        `disable_by_batch_size` running requests, or while its acceptance has it paused."""
        cfg, p = self.cfg, req.params
        if cfg is None or not p.speculative or p.grammar is not None or not req.output_token_ids:
            return 0
        if not step_allows(cfg, num_running) or not request_allows(req.spec_acceptance):
            return 0
        left = p.max_tokens - len(req.output_token_ids) - 1
        return max(0, min(cfg.num_speculative_tokens, room, max_model_len - req.num_tokens, left))

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        """Up to k proposed tokens after req's last token."""
        cfg = self.cfg
        if cfg is None or k < 1:
            return ()
        ids = req.all_token_ids
        return propose_ngram(ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def accept(self, req: Request, draft: Sequence[int], drawn: Sequence[int]) -> int:
        """Tokens the verify row yields: the accepted proposals (each equal to the token drawn
        at its position) and then one drawn token (the correction, or the bonus after all)."""
        accepted = 0
        while accepted < len(draft) and drawn[accepted] == draft[accepted]:
            accepted += 1
        self._count(len(draft), accepted)
        if self.cfg is not None:
            observe(self.cfg, req.spec_acceptance, len(draft), accepted)
        return accepted + 1

    def _count(self, proposed: int, accepted: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += proposed
        c.num_accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_pos[i] += 1
        c.accepted_lengths[accepted] += 1
