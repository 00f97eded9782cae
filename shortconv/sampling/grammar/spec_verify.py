"""Grammars under speculative decoding: the proposals a grammar allows, and a mask per position.

A verify row scores a request's last token then k proposals, and position i is drawn as if
proposals 0..i-1 had been accepted (engine.speculation), so its mask is the matcher's state
after them. Both helpers advance the matcher over the proposals and roll it back before they
return: the matcher only ever keeps the tokens the engine emits (`GrammarRuntime.accept`),
which are the accepted ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shortconv.sampling.grammar.spec import GrammarError


def allowed_prefix(matcher: Any, draft: Sequence[int]) -> int:
    """How many leading proposals the grammar allows. A proposal it forbids, and every one
    after it, is cut before the verify, so it can never be accepted. A proposal that would
    complete the grammar is cut too: it ends the request, so it is drawn (the correction or the
    bonus), never proposed, and no position after a complete grammar needs a mask."""
    advanced = 0
    for tok in draft:
        if not matcher.accept_token(tok):
            break
        advanced += 1
        if matcher.is_terminated():
            break
    allowed = advanced - 1 if advanced and matcher.is_terminated() else advanced
    matcher.rollback(advanced)
    return allowed


def fill_verify_masks(matcher: Any, draft: Sequence[int], masks: Any, first_row: int) -> None:
    """Rows first_row .. first_row + len(draft) of `masks` (xgrammar's int32 bitmask): row i
    holds the tokens allowed after proposals 0..i-1. The draft passed `allowed_prefix` when
    the step was scheduled, and the matcher has not moved since."""
    for i, tok in enumerate(draft):
        matcher.fill_next_token_bitmask(masks, first_row + i)
        if not matcher.accept_token(tok):
            matcher.rollback(i)
            raise GrammarError(f"proposed token {tok} does not fit the output grammar")
    matcher.fill_next_token_bitmask(masks, first_row + len(draft))
    matcher.rollback(len(draft))
