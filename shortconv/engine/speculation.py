"""Speculative decoding on the scheduler's side: what a request proposes, and what it accepts.

A speculating request's decode row becomes a verify row: its last token then k proposed
tokens (n-gram lookup, `engine.ngram`, or a draft model, `engine.draft_proposer`), k + 1
positions scored in one forward. Each position is sampled with the row the request would
have had there had the proposals before it been accepted (its step, so its seeded draw, and
its penalty history), and a proposal is accepted while it equals the token drawn at its
position; the first draw that differs (or the draw after the last proposal) is the step's
last token. With one-hot proposals this is exactly rejection sampling, so greedy and seeded
sampling alike give what decoding one token a step gives (docs/speculative_decoding.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shortconv.configs.speculative import SpeculativeConfig
from shortconv.engine.ngram import propose_ngram
from shortconv.engine.request import Request
from shortconv.engine.spec_policy import (
    adaptive_k,
    fixed_k,
    observe,
    request_allows,
    step_allows,
)

if TYPE_CHECKING:
    import torch

    from shortconv.engine.draft_proposer import DraftProposer


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

    def __init__(self, cfg: SpeculativeConfig | None, draft: DraftProposer | None = None) -> None:
        """`draft`: method draft_model's proposer, built at start-up (`engine.draft_model`)."""
        self.cfg = cfg
        self.draft = draft
        self.step = 0  # schedule() calls so far: the clock of the acceptance pauses
        # Bound once: k per request from its acceptance, or always num_speculative_tokens.
        self._k_for = adaptive_k if cfg is not None and cfg.adaptive_k else fixed_k
        k = cfg.num_speculative_tokens if cfg is not None else 0
        self.counters = SpecCounters(accepted_per_pos=[0] * k, accepted_lengths=[0] * (k + 1))

    def limit(self, req: Request, room: int, max_model_len: int, num_running: int = 1) -> int:
        """The most tokens req may propose this step: its k (`spec_policy`), within `room`
        budget tokens beyond its own, the positions left before `max_model_len`, and
        `max_tokens` (a verify row adds at most k + 1 tokens); 0 for a request that does not
        speculate, in a step of more than `disable_by_batch_size` running requests, or while
        its acceptance has it paused. A request with a grammar speculates too: the scheduler
        cuts the proposals its grammar forbids."""
        cfg, p = self.cfg, req.params
        if cfg is None or not p.speculative or not req.output_token_ids:
            return 0
        if not step_allows(cfg, num_running) or not request_allows(req.spec_acceptance, self.step):
            return 0
        left = p.max_tokens - len(req.output_token_ids) - 1
        k = self._k_for(cfg, req.spec_acceptance)
        return max(0, min(k, room, max_model_len - req.num_tokens, left))

    def prepare(
        self, decoding: Sequence[Request], room: int, max_model_len: int, num_running: int = 1
    ) -> None:
        """Before a step's rows are planned (once per step: it advances the pause clock): a
        draft model proposes for every request that may speculate, in one batch (n-gram
        lookup needs no batch: nothing to do)."""
        self.step += 1
        if self.draft is not None:
            wants = [
                (r, k)
                for r in decoding
                if (k := self.limit(r, room, max_model_len, num_running)) > 0
            ]
            self.draft.prepare(wants)

    def release(self, req: Request) -> None:
        """req leaves or is preempted: the draft's state of it goes back."""
        if self.draft is not None:
            self.draft.release(req)

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        """Up to k proposed tokens after req's last token."""
        cfg = self.cfg
        if cfg is None or k < 1:
            return ()
        if self.draft is not None:
            return self.draft.propose(req, k)
        ids = req.all_token_ids
        return propose_ngram(ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def draft_probs(self, req: Request, k: int) -> torch.Tensor | None:
        """q [k, V] of the k proposals `propose` gave req, when its draft sampled them."""
        return self.draft.probs(req, k) if self.draft is not None else None

    def accept(self, req: Request, draft: Sequence[int], drawn: Sequence[int]) -> int:
        """Tokens the verify row yields: the accepted proposals (each equal to the token drawn
        at its position) and then one drawn token (the correction, or the bonus after all)."""
        accepted = 0
        while accepted < len(draft) and drawn[accepted] == draft[accepted]:
            accepted += 1
        self._count(len(draft), accepted)
        if self.cfg is not None:
            observe(self.cfg, req.spec_acceptance, len(draft), accepted, self.step)
        return accepted + 1

    def _count(self, proposed: int, accepted: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += proposed
        c.num_accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_pos[i] += 1
        c.accepted_lengths[accepted] += 1
