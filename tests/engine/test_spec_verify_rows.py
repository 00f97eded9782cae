"""A verify step's rows are resolved once per step (`StepTensors.verify`), and the fused CPU
short conv that reads them gives what the per-layer path gives, bit for bit.

The oracle is the same engine with the step resolution switched off (every layer then writes
its checkpoints and runs `causal_conv1d_fn`, as before): tokens, logprobs and top logprobs
must be equal floats, not close ones. Speculation off against on is test_spec_decode's."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

import shortconv.execution.step_inputs as step_inputs
import shortconv.layers.short_conv as short_conv
from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.execution.state_checkpoints import build_verify_rows
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.sampling.sampling_row import SamplingRow
from tests.engine.test_spec_decode import (
    PROMPTS,
    SPEC,
    assert_accepts_and_rejects,
    engine,
    make_ckpt,
    run,
)

ROW = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)


def _chunk(n: int, start: int, slot: int, ckpts: tuple[tuple[int, int], ...]) -> SeqChunk:
    return SeqChunk(
        request_id=f"r{slot}",
        token_ids=tuple(range(4, 4 + n)),
        start_pos=start,
        slot=slot,
        block_table=(1, 2),
        sampling=ROW,
        checkpoints=ckpts,
        draft_rows=(ROW,) * len(ckpts),
    )


def _plan(*seqs: SeqChunk) -> StepPlan:
    return StepPlan(step_id=1, seqs=seqs)


def test_verify_rows_resolved_only_for_verify_shaped_steps() -> None:
    a = _chunk(3, 5, slot=2, ckpts=((1, 7), (2, 8)))
    b = _chunk(3, 9, slot=3, ckpts=((1, 4), (2, 5)))
    rows = build_verify_rows(_plan(a, b), torch.device("cpu"))
    assert rows is not None and rows.width == 3
    assert rows.state_slots.tolist() == [7, 8, 2, 4, 5, 3]
    assert rows.state_slots.dtype == torch.int64
    not_verify = [
        _plan(_chunk(1, 5, 2, ())),  # decode
        _plan(a, _chunk(2, 9, 3, ((1, 4),))),  # unequal widths
        _plan(_chunk(3, 0, 2, ((1, 7), (2, 8)))),  # a fresh prompt chunk
        _plan(_chunk(3, 5, 2, ((2, 7), (1, 8)))),  # checkpoints out of order
        _plan(_chunk(3, 5, 2, ((1, 7),))),  # a position without its checkpoint
    ]
    for plan in not_verify:
        assert build_verify_rows(plan, torch.device("cpu")) is None


@pytest.fixture(scope="module", params=["lfm2", "lfm3"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(request.param, tmp_path_factory.mktemp(request.param))


def test_fused_verify_conv_equals_the_per_layer_path(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)
    fused = mock.Mock(wraps=short_conv.verify_conv1d_cpu)
    monkeypatch.setattr(short_conv, "verify_conv1d_cpu", fused)
    # One request at a time: batch 1, where every verify step is verify-shaped (in a batch,
    # rows of different k make a step that is not, and it runs the per-layer path).
    eng = engine(ckpt, SPEC)
    ours = [run(eng, [p], params).outputs[0] for p in PROMPTS]
    assert fused.call_count, "no verify step took the fused conv: this test would compare nothing"
    assert_accepts_and_rejects(eng)

    monkeypatch.setattr(step_inputs, "build_verify_rows", lambda plan, device: None)
    n_fused = fused.call_count
    eng = engine(ckpt, SPEC)
    ref = [run(eng, [p], params).outputs[0] for p in PROMPTS]
    assert fused.call_count == n_fused  # the oracle ran the per-layer path only
    for a, b in zip(ours, ref, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
