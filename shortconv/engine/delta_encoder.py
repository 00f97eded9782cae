"""Driver side of the step message: a StepPlan becomes a StepDelta against what ranks hold.

Stream layout (int64 each; `[n, ...]` is a length then its values):
  step_id, [dropped handles], num_rows, rows..., [copies_after flat], [copies_before flat],
  [page_copies flat], [encoder_frees], num_encoder_inputs
  row: handle, flags, start_pos, [token_ids], (slot), (lora_slot), (num_groups, per group:
       zeros, keep, [tail]), [checkpoints flat], (sampling: num_draft, then each row's
       sample), num_forks, per fork: handle, sample
  sample: flags, step, (seed), prompt edit (zeros, keep, [tail]), output edit, [banned]
A handle not seen before takes the next id of `new_ids`; objects follow the stream's order.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.engine.row_state import RowState, SampleRef
from shortconv.engine.step_delta import (
    IntWriter,
    RowFlag,
    SampleFlag,
    StepDelta,
    tuple_edit,
)
from shortconv.sampling.sampling_row import SamplingRow


class StepDeltaEncoder:
    """Keeps a mirror of every rank's persistent batch and encodes each plan against it."""

    def __init__(self) -> None:
        self.rows: dict[str, RowState] = {}
        self._next_handle = 1

    def encode(self, plan: StepPlan) -> StepDelta:
        msg = _Message()
        msg.ints.put(plan.step_id)
        dropped = [self.rows.pop(rid).handle for rid in plan.released if rid in self.rows]
        msg.ints.put_seq(dropped)
        msg.ints.put(len(plan.seqs))
        for chunk in plan.seqs:
            self._row(chunk, msg)
        msg.ints.put_seq(list(chain.from_iterable(plan.copies_after)))
        msg.ints.put_seq(list(chain.from_iterable(plan.copies_before)))
        msg.ints.put_seq(list(chain.from_iterable(plan.page_copies)))
        msg.ints.put_seq(plan.encoder_frees)
        msg.ints.put(len(plan.encoder_inputs))
        msg.objects.extend(plan.encoder_inputs)
        return StepDelta(msg.ints.tobytes(), tuple(msg.new_ids), tuple(msg.objects))

    def _state(self, request_id: str, msg: _Message) -> RowState:
        """The request's mirror entry (a new one is named in the message); writes its handle."""
        state = self.rows.get(request_id)
        if state is None:
            state = self.rows[request_id] = RowState(self._next_handle, request_id)
            self._next_handle += 1
            msg.new_ids.append(request_id)
        msg.ints.put(state.handle)
        return state

    def _row(self, chunk: SeqChunk, msg: _Message) -> None:
        state, ints = self._state(chunk.request_id, msg), msg.ints
        tables = chunk.tables
        flags = (
            (RowFlag.SLOT if chunk.slot != state.slot else 0)
            | (RowFlag.TABLES if tables != state.tables else 0)
            | (RowFlag.SAMPLING if chunk.sampling is not None else 0)
            | (RowFlag.IMAGES if chunk.images else 0)
            | (RowFlag.LORA if chunk.lora_slot != state.lora_slot else 0)
            | (RowFlag.DRAFT_PROBS if chunk.draft_probs is not None else 0)
        )
        ints.put(flags, chunk.start_pos)
        ints.put_seq(chunk.token_ids)
        if flags & RowFlag.SLOT:
            ints.put(chunk.slot)
        if flags & RowFlag.LORA:
            ints.put(chunk.lora_slot)
        if flags & RowFlag.TABLES:
            ints.put(len(tables))
            for g, new in enumerate(tables):
                _put_edit(ints, state.tables[g] if g < len(state.tables) else (), new)
        ints.put_seq(list(chain.from_iterable(chunk.checkpoints)))
        if flags & RowFlag.IMAGES:
            msg.objects.append(chunk.images)
        if flags & RowFlag.DRAFT_PROBS:
            msg.objects.append(chunk.draft_probs)
        if chunk.sampling is not None:
            ints.put(chunk.num_draft)
            for row in (*chunk.draft_rows, chunk.sampling):
                _put_sample(state.sample, row, msg)
        ints.put(len(chunk.fork_rows))
        for fork_id, row in chunk.fork_rows:
            _put_sample(self._state(fork_id, msg).sample, row, msg)
        state.slot, state.tables, state.lora_slot = chunk.slot, tables, chunk.lora_slot


class _Message:
    def __init__(self) -> None:
        self.ints = IntWriter()
        self.new_ids: list[str] = []
        self.objects: list[Any] = []


def _put_edit(ints: IntWriter, old: tuple[int, ...], new: tuple[int, ...]) -> None:
    zeros, keep, tail = tuple_edit(old, new)
    ints.put(zeros, keep)
    ints.put_seq(tail)


def _put_sample(ref: SampleRef, row: SamplingRow, msg: _Message) -> None:
    """`row` as edits to `ref` (the request's previous row), then `ref` becomes `row`."""
    new_params = row.params is not ref.params and row.params != ref.params
    flags = (
        (SampleFlag.PARAMS if new_params else 0)
        | (SampleFlag.SEED if row.seed != ref.seed else 0)
        | (SampleFlag.MASK if row.token_mask is not None else 0)
    )
    msg.ints.put(flags, row.step)
    if flags & SampleFlag.SEED:
        msg.ints.put(row.seed)
    _put_edit(msg.ints, ref.prompt, row.prompt_token_ids)
    _put_edit(msg.ints, ref.output, row.output_token_ids)
    msg.ints.put_seq(row.banned_token_ids)
    if new_params:
        msg.objects.append(row.params)
    if row.token_mask is not None:
        msg.objects.append(row.token_mask)
    ref.params, ref.seed = row.params, row.seed
    ref.prompt, ref.output = row.prompt_token_ids, row.output_token_ids
