"""The step's prefix-cache checkpoints, resolved once per step like the rest of the metadata.

`SeqChunk.checkpoints` names, per chunk, positions inside it whose recurrent state goes to a
checkpoint slot; `build_state_checkpoints` packs them into device tensors (the step builder
puts them on `StepTensors.checkpoints`), and each conv-like layer calls `checkpoint_state` with
its state inputs before its kernel updates the live slots.
"""

from __future__ import annotations

import torch

from shortconv.engine.plan import StepPlan
from shortconv.execution.step_tensors import StateCheckpoints, StepTensors, VerifyRows
from shortconv.kernels.state_checkpoint import save_state_checkpoints


def build_state_checkpoints(plan: StepPlan, device: torch.device) -> StateCheckpoints | None:
    rows = [(b, j, s) for b, c in enumerate(plan.seqs) for j, s in c.checkpoints]
    if not rows:
        return None
    seq, length, slot = torch.tensor(rows, dtype=torch.int64).t().to(device).unbind(0)
    return StateCheckpoints(seq, length, slot)


def build_verify_rows(plan: StepPlan, device: torch.device) -> VerifyRows | None:
    """The step's `VerifyRows` when every row resumes its state with the same width > 1 and
    checkpoints exactly its positions 1..width-1 in order (a verify step's rows); else None.
    Host work on the plan, once per step: the layers then skip their own checks."""
    width = plan.seqs[0].num_tokens
    if width < 2:
        return None
    slots: list[int] = []
    for s in plan.seqs:
        lengths = tuple(j for j, _ in s.checkpoints)
        if s.num_tokens != width or s.start_pos < 1 or lengths != tuple(range(1, width)):
            return None
        slots += [dst for _, dst in s.checkpoints] + [s.slot]
    return VerifyRows(width, torch.tensor(slots, dtype=torch.int64, device=device))


def checkpoint_state(x: torch.Tensor, state: torch.Tensor, step: StepTensors) -> None:
    """Write the step's checkpoints of one state kind: x [C, T] the layer's packed state
    inputs, state `[n_slots, C, K]` (a `[n_slots, D]` state is viewed as K = 1)."""
    ck = step.checkpoints
    if ck is None:
        return
    view = state.unsqueeze(-1) if state.dim() == 2 else state
    save_state_checkpoints(
        x,
        view,
        step.query_start_loc,
        step.cache_indices,
        step.has_initial_state,
        ck.seq,
        ck.length,
        ck.slot,
    )
