"""The sampling rows of a step, each constrained one made with its grammar mask.

The scheduler builds a chunk's rows when it decides the chunk, and asks the grammar runtime
for a constrained request's masks right then (issue #45), so the StepPlan is built once, masks
in it, and nothing rewrites it after the decision. A request whose grammar cannot go on is
noted here; the scheduler drops its chunk and finishes it with an error before the plan is
built, and the engine reports it (`take_failed`).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Protocol

from shortconv.engine.request import Request
from shortconv.sampling.grammar.spec import GrammarError, GrammarSpec
from shortconv.sampling.sampling_row import SamplingRow, make_row


class StepGrammar(Protocol):
    """What the scheduler asks of the engine's grammar runtime (`GrammarRuntime`)."""

    def allowed_draft(self, request_id: str, spec: GrammarSpec, draft: Sequence[int]) -> int: ...

    def row_masks(
        self, request_id: str, spec: GrammarSpec, draft: Sequence[int] = ()
    ) -> tuple[bytes | None, ...]: ...

    def prune(self, live: Container[str]) -> None: ...


class NoGrammar:
    """A scheduler without a grammar runtime (one built on its own): a constrained request
    proposes nothing and its rows carry no mask."""

    def allowed_draft(self, request_id: str, spec: GrammarSpec, draft: Sequence[int]) -> int:
        return 0

    def row_masks(
        self, request_id: str, spec: GrammarSpec, draft: Sequence[int] = ()
    ) -> tuple[bytes | None, ...]:
        return (None,) * (len(draft) + 1)

    def prune(self, live: Container[str]) -> None:
        return None


class StepRows:
    """Makes the rows of the chunks the scheduler decides; collects the requests whose grammar
    could not give a row a mask ({request id: (request, why)})."""

    def __init__(self, eos_token_ids: Sequence[int], grammar: StepGrammar | None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammar: StepGrammar = grammar if grammar is not None else NoGrammar()
        self.failed: dict[str, tuple[Request, str]] = {}

    def row(self, req: Request) -> SamplingRow:
        """req's row for its next token (`rows` with no proposals, without their loop)."""
        mask = self._masks(req, ())[0] if req.params.grammar is not None else None
        out, eos = req.output_token_ids, self.eos_token_ids
        return make_row(req.params, req.seed, req.prompt_token_ids, out, eos, mask)

    def rows(self, req: Request, draft: Sequence[int]) -> tuple[SamplingRow, ...]:
        """req's rows for its next len(draft) + 1 positions (a verify row), position i's with
        proposals 0..i-1 taken as generated. A failed grammar's rows are unmasked: their
        chunk is dropped before the plan is built."""
        masks = self._masks(req, draft)
        p, eos, out = req.params, self.eos_token_ids, req.output_token_ids
        return tuple(
            make_row(p, req.seed, req.prompt_token_ids, [*out, *draft[:i]] if i else out, eos, m)
            for i, m in enumerate(masks)
        )

    def allowed_draft(self, req: Request, draft: tuple[int, ...]) -> int:
        """How many of a constrained request's proposals its grammar allows."""
        assert req.params.grammar is not None  # NOTE: asked for constrained requests only
        return self.grammar.allowed_draft(req.request_id, req.params.grammar, draft)

    def take_failed(self) -> list[tuple[Request, str]]:
        """The requests failed since the last call, and why (the engine reports them)."""
        failed, self.failed = list(self.failed.values()), {}
        return failed

    def _masks(self, req: Request, draft: Sequence[int]) -> Sequence[bytes | None]:
        spec = req.params.grammar
        if spec is None:
            return (None,) * (len(draft) + 1)
        try:
            return self.grammar.row_masks(req.request_id, spec, draft)
        except GrammarError as exc:
            self.failed[req.request_id] = (req, str(exc))
            return (None,) * (len(draft) + 1)
