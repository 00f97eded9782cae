"""Step inputs with a sliding-window KV group: each group's block table and slot mapping, in
eager steps and graph buckets alike; the backend hands each layer its group's view."""

from __future__ import annotations

import pytest
import torch

from shortconv.cache.state_pool import KVSpec, StatePool, StateSpec
from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.execution.backend import ShortConvBackend
from shortconv.execution.step_inputs import DecodeShape, StepInputs

PAGE = 4
CPU = torch.device("cpu")
# Row 0 decodes at position 21 (pages 0..3 behind a window of 8 are scratch in group 1);
# row 1 decodes at position 6.
ROWS = (
    SeqChunk("a", (3,), 21, 2, (1, 2, 3, 4, 5, 6), None, window_tables=((0, 0, 0, 0, 7, 8),)),
    SeqChunk("b", (4,), 6, 5, (9, 10), None, window_tables=((11, 12),)),
)


def _plan(rows: tuple[SeqChunk, ...] = ROWS) -> StepPlan:
    return StepPlan(1, rows)


def test_eager_step_carries_each_groups_tables_and_kv_rows() -> None:
    inputs = StepInputs(PAGE, CPU, num_kv_groups=2)
    step = inputs.build(_plan())
    (window,) = step.windows
    assert step.block_tables.tolist() == [[1, 2, 3, 4, 5, 6], [9, 10, 0, 0, 0, 0]]
    assert window.block_tables.tolist() == [[0, 0, 0, 0, 7, 8], [11, 12, 0, 0, 0, 0]]
    assert step.slot_mapping.tolist() == [6 * PAGE + 1, 10 * PAGE + 2]
    assert window.slot_mapping.tolist() == [8 * PAGE + 1, 12 * PAGE + 2]


def test_graph_bucket_expands_every_group_and_pads_with_scratch() -> None:
    inputs = StepInputs(PAGE, CPU, num_kv_groups=2)
    shape = DecodeShape(4, 32)
    inputs.reserve(4, 4, 32)
    inputs.refresh(_plan(), shape)
    inputs.derive(shape)
    step = inputs.graph_step(shape)
    (window,) = step.windows
    assert window.block_tables.shape == (4, 8)
    assert window.block_tables[0].tolist() == [0, 0, 0, 0, 7, 8, 0, 0]
    assert window.block_tables[1].tolist() == [11, 12] + [0] * 6
    assert not window.block_tables[2:].any() and not window.slot_mapping[2:].any()
    assert window.slot_mapping[:2].tolist() == [8 * PAGE + 1, 12 * PAGE + 2]
    inputs.refresh(None, shape)  # a later all-scratch refresh leaves nothing behind
    inputs.derive(shape)
    assert not window.block_tables.any() and not window.slot_mapping.any()


def test_a_table_that_would_write_the_scratch_page_is_refused() -> None:
    inputs = StepInputs(PAGE, CPU, num_kv_groups=2)
    freed = SeqChunk("c", (3,), 21, 2, (1, 2, 3, 4, 5, 6), None, window_tables=((0,) * 6,))
    with pytest.raises(ValueError, match="scratch page where positions 21..21"):
        inputs.build(_plan((freed,)))
    missing = SeqChunk("d", (3,), 0, 2, (1,), None)
    with pytest.raises(ValueError, match="1 block tables, need 2"):
        inputs.build(_plan((missing,)))


def test_backend_gives_each_layer_its_groups_caches_indices_and_window() -> None:
    kv = (KVSpec((1,), 2, 4, PAGE, 16), KVSpec((3, 5), 2, 4, PAGE, 10, window=8))
    pool = StatePool([StateSpec("conv", (0, 2, 4), (4, 2))], kv, 8, torch.float32, CPU)
    backend = ShortConvBackend(pool, CPU)
    step = backend.begin_step(_plan())
    full, sliding = backend.attention_metadata(1), backend.attention_metadata(5)
    assert full.window == 0 and full.step is step and full.k_cache.shape[0] == 16 * PAGE
    assert sliding.window == 8 and sliding.k_cache.shape[0] == 10 * PAGE
    assert sliding.step.block_tables is step.windows[0].block_tables
    assert sliding.step.slot_mapping is step.windows[0].slot_mapping
    assert sliding.step.seq_lens is step.seq_lens  # everything else is the step's own
    assert sliding.k_cache.data_ptr() == pool.kv_caches[1][0][1].data_ptr()
