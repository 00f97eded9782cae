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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shortconv.configs.speculative import SpeculativeConfig
from shortconv.engine.ngram import propose_ngram
from shortconv.engine.request import Request

if TYPE_CHECKING:
    from shortconv.engine.draft_proposer import DraftProposer


@dataclass
class SpecCounters:
    """Since start-up: verify rows run, tokens proposed in them, proposals accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Speculator:
    """Proposals and acceptance for one scheduler (no state but its counters)."""

    def __init__(self, cfg: SpeculativeConfig | None, draft: DraftProposer | None = None) -> None:
        """`draft`: method draft_model's proposer, built at start-up (`engine.draft_model`)."""
        self.cfg = cfg
        self.draft = draft
        self.counters = SpecCounters()

    def limit(self, req: Request, room: int, max_model_len: int) -> int:
        """The most tokens req may propose this step: k, within `room` budget tokens beyond its
        own, the positions left before `max_model_len`, and `max_tokens` (a verify row adds at
        most k + 1 tokens); 0 for a request that does not speculate. A request with a grammar
        speculates too: the scheduler cuts the proposals its grammar forbids."""
        cfg, p = self.cfg, req.params
        if cfg is None or not p.speculative or not req.output_token_ids:
            return 0
        left = p.max_tokens - len(req.output_token_ids) - 1
        return max(0, min(cfg.num_speculative_tokens, room, max_model_len - req.num_tokens, left))

    def prepare(self, decoding: Sequence[Request], room: int, max_model_len: int) -> None:
        """Before a step's rows are planned: a draft model proposes for every request that may
        speculate, in one batch (n-gram lookup needs no batch: nothing to do)."""
        if self.draft is not None:
            wants = [(r, k) for r in decoding if (k := self.limit(r, room, max_model_len)) > 0]
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

    def accept(self, draft: Sequence[int], drawn: Sequence[int]) -> int:
        """Tokens the verify row yields: the accepted proposals (each equal to the token drawn
        at its position) and then one drawn token (the correction, or the bonus after all)."""
        accepted = 0
        while accepted < len(draft) and drawn[accepted] == draft[accepted]:
            accepted += 1
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += len(draft)
        c.num_accepted_tokens += accepted
        return accepted + 1
