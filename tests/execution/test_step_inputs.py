"""StepInputs' buffers: grown on demand for eager steps, fixed once a graph has captured them."""

from __future__ import annotations

import pytest
import torch

from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.execution.step_inputs import DecodeShape, StepInputs

PAGE = 4


def _plan(n_tokens: int, rows: int = 1) -> StepPlan:
    pages = -(-n_tokens // PAGE)
    return StepPlan(
        1,
        tuple(
            SeqChunk(
                f"r{i}",
                (3,) * n_tokens,
                0,
                i + 1,
                tuple(range(1 + i * pages, 1 + (i + 1) * pages)),
                None,
            )
            for i in range(rows)
        ),
    )


def test_buffers_grow_for_eager_steps_until_frozen() -> None:
    inputs = StepInputs(PAGE, torch.device("cpu"))
    big = inputs.build(_plan(40, rows=3))  # grows from the initial one-row buffers
    assert big.num_tokens == 120 and big.block_tables.shape == (3, 10)
    inputs.reserve(16, 4, 64)  # what a graph runner does before it captures
    shape = DecodeShape(4, 64)
    step = inputs.graph_step(shape)
    ptrs = [t.data_ptr() for t in (inputs.primary, inputs.block_tables, step.input_ids)]
    inputs.freeze()
    assert inputs.build(_plan(60)).num_tokens == 60  # fits the reserved room: same buffers
    with pytest.raises(ValueError, match="exceeds the captured step buffers"):
        inputs.build(_plan(40, rows=5))  # would reallocate under the captured graphs
    assert [t.data_ptr() for t in (inputs.primary, inputs.block_tables, step.input_ids)] == ptrs
    assert inputs.graph_step(shape) is step


def test_a_bucket_is_initialised_to_scratch_rows_before_capture() -> None:
    """refresh(None) (the capture's warm-up) writes every row as a scratch row: slot 0,
    position 0, page 0, no resumed state; nothing is left from an earlier eager step."""
    inputs = StepInputs(PAGE, torch.device("cpu"))
    inputs.build(_plan(7, rows=4))
    shape = DecodeShape(4, 16)
    inputs.refresh(None, shape)
    inputs.derive(shape)
    step = inputs.graph_step(shape)
    for t in (step.input_ids, step.positions, step.cache_indices, step.slot_mapping):
        assert not t.any()
    assert not step.block_tables.any() and not step.has_initial_state.any()
    assert step.seq_lens.tolist() == [1] * 4 and step.query_start_loc.tolist() == [0, 1, 2, 3, 4]
