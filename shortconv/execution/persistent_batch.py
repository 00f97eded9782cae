"""Rank side of the step message: a persistent batch that applies each StepDelta.

Every rank keeps the running requests' slots, block tables (window tables included) and
sampling history between steps, keyed by the handle the driver's `StepDeltaEncoder` gave them,
and rebuilds the step's full `StepPlan` from the delta. The runner (and `step_layout`) keep
consuming a StepPlan: the least invasive seam, so graph capture, the backend and the sampler
are untouched; what shrank is the message, which no longer grows with context length.
"""

from __future__ import annotations

from typing import Any

from shortconv.engine.images import ImageSlice
from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.engine.row_state import RowState, SampleRef
from shortconv.engine.step_delta import (
    IntReader,
    RowFlag,
    SampleFlag,
    StepDelta,
    apply_edit,
)
from shortconv.sampling.sampling_row import SamplingRow


class PersistentBatch:
    """One rank's view of the running batch; `apply(delta)` returns the step's StepPlan."""

    def __init__(self) -> None:
        self.rows: dict[int, RowState] = {}

    def request_ids(self) -> set[str]:
        return {r.request_id for r in self.rows.values()}

    def apply(self, delta: StepDelta) -> StepPlan:
        d = _Decoding(delta)
        step_id = d.ints.get()
        for handle in d.ints.get_seq():
            self.rows.pop(handle, None)
        seqs = tuple(self._row(d) for _ in range(d.ints.get()))
        copies_after = _pairs(d.ints.get_seq())
        copies_before = _pairs(d.ints.get_seq())
        page_copies = _triples(d.ints.get_seq())
        encoder_frees = d.ints.get_seq()
        encoder_inputs = tuple(d.object() for _ in range(d.ints.get()))
        if not d.ints.done() or d.new_at != len(delta.new_ids) or d.obj_at != len(delta.objects):
            raise ValueError(f"step {step_id}: malformed step message (trailing data)")
        return StepPlan(
            step_id,
            seqs,
            copies_after=copies_after,
            copies_before=copies_before,
            page_copies=page_copies,
            encoder_inputs=encoder_inputs,
            encoder_frees=encoder_frees,
        )

    def _state(self, d: _Decoding) -> RowState:
        handle = d.ints.get()
        state = self.rows.get(handle)
        if state is None:
            state = self.rows[handle] = RowState(handle, d.new_id())
        return state

    def _row(self, d: _Decoding) -> SeqChunk:
        state, ints = self._state(d), d.ints
        flags, start_pos = ints.get(), ints.get()
        token_ids = ints.get_seq()
        if flags & RowFlag.SLOT:
            state.slot = ints.get()
        if flags & RowFlag.LORA:
            state.lora_slot = ints.get()
        if flags & RowFlag.TABLES:
            old = state.tables
            state.tables = tuple(
                _edit(ints, old[g] if g < len(old) else ()) for g in range(ints.get())
            )
        checkpoints = _pairs(ints.get_seq())
        images: tuple[ImageSlice, ...] = d.object() if flags & RowFlag.IMAGES else ()
        draft_probs = d.object() if flags & RowFlag.DRAFT_PROBS else None
        rows: list[SamplingRow] = []
        if flags & RowFlag.SAMPLING:
            rows = [_sample(state.sample, d) for _ in range(ints.get() + 1)]
        forks = []
        for _ in range(ints.get()):
            fork = self._state(d)
            forks.append((fork.request_id, _sample(fork.sample, d)))
        return SeqChunk(
            request_id=state.request_id,
            token_ids=token_ids,
            start_pos=start_pos,
            slot=state.slot,
            block_table=state.tables[0],
            sampling=rows[-1] if rows else None,
            checkpoints=checkpoints,
            window_tables=state.tables[1:],
            images=images,
            fork_rows=tuple(forks),
            draft_rows=tuple(rows[:-1]),
            lora_slot=state.lora_slot,
            draft_probs=draft_probs,
        )


class _Decoding:
    """A cursor over one delta's three parts."""

    def __init__(self, delta: StepDelta) -> None:
        self.delta, self.ints = delta, IntReader(delta.ints)
        self.new_at = self.obj_at = 0

    def new_id(self) -> str:
        self.new_at += 1
        return self.delta.new_ids[self.new_at - 1]

    def object(self) -> Any:
        self.obj_at += 1
        return self.delta.objects[self.obj_at - 1]


def _pairs(flat: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(zip(flat[0::2], flat[1::2], strict=True))


def _triples(flat: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    return tuple(zip(flat[0::3], flat[1::3], flat[2::3], strict=True))


def _edit(ints: IntReader, old: tuple[int, ...]) -> tuple[int, ...]:
    zeros, keep = ints.get(), ints.get()
    return apply_edit(old, zeros, keep, ints.get_seq())


def _sample(ref: SampleRef, d: _Decoding) -> SamplingRow:
    """The next sampling row from edits to `ref`; `ref` becomes it (`_put_sample`'s inverse)."""
    flags, step = d.ints.get(), d.ints.get()
    if flags & SampleFlag.SEED:
        ref.seed = d.ints.get()
    ref.prompt = _edit(d.ints, ref.prompt)
    ref.output = _edit(d.ints, ref.output)
    banned = d.ints.get_seq()
    if flags & SampleFlag.PARAMS:
        ref.params = d.object()
    mask = d.object() if flags & SampleFlag.MASK else None
    assert ref.params is not None  # NOTE: a request's first row always carries its params
    return SamplingRow(
        ref.params,
        ref.seed,
        step,
        token_mask=mask,
        prompt_token_ids=ref.prompt,
        output_token_ids=ref.output,
        banned_token_ids=banned,
    )
