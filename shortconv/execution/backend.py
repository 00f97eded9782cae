"""Per-step metadata resolver: everything the conv and attention layers need, resolved ONCE.

`ShortConvBackend.begin_step(plan)` turns a `StepPlan` into device tensors (slot indices,
`query_start_loc`, `has_initial_state`, KV gather indices, ...). Layers then call
`conv_state_metadata(layer_id)` / `attention_metadata(layer_id)` and get cheap views; they never
touch the pool's bookkeeping and never re-derive per-step indices per layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from shortconv.cache.state_pool import StatePool
from shortconv.engine.plan import StepPlan
from shortconv.execution.step_inputs import StepInputs
from shortconv.execution.step_tensors import StepTensors
from shortconv.kernels.scratch import StepScratch


@dataclass(frozen=True)
class ShortConvMetadata:
    """A conv layer's view of the step.

    conv_state: `[n_slots, conv_dim, width-1]` this layer's pool tensor; cache_indices int64 [B];
    query_start_loc int32 [B+1]; has_initial_state bool [B]; `extra_state` is the layer's second
    state (ZAYA1's previous-token value, `[n_slots, dim]`) or None. Host mirrors are for extend.
    """

    conv_state: torch.Tensor
    cache_indices: torch.Tensor
    query_start_loc: torch.Tensor
    has_initial_state: torch.Tensor
    is_decode: bool
    step: StepTensors
    extra_state: torch.Tensor | None = None

    @property
    def query_start_loc_cpu(self) -> torch.Tensor:
        return self.step.query_start_loc_cpu

    @property
    def has_initial_state_cpu(self) -> torch.Tensor:
        return self.step.has_initial_state_cpu


@dataclass(frozen=True)
class AttentionMetadata:
    """An attention layer's view: its KV group's flat pages, the step's indices with that
    group's `slot_mapping` and `block_tables`, and the group's window (0: the whole context)."""

    k_cache: torch.Tensor  # [pages*page_size, Hk, d]
    v_cache: torch.Tensor
    step: StepTensors
    scratch: StepScratch | None = None  # the backend's reusable buffers (CPU kernels use them)
    window: int = 0


class BaseStateBackend(ABC):
    """What every model needs from a backend. An incomplete backend fails at construction
    (start-up), not at the first request that reaches the missing method."""

    @abstractmethod
    def begin_step(self, plan: StepPlan) -> StepTensors: ...

    @abstractmethod
    def bind(self, step: StepTensors) -> None: ...

    @abstractmethod
    def conv_state_metadata(self, layer_id: int) -> ShortConvMetadata: ...

    @abstractmethod
    def attention_metadata(self, layer_id: int) -> AttentionMetadata: ...

    @property
    @abstractmethod
    def step(self) -> StepTensors: ...


class ShortConvBackend(BaseStateBackend):
    """The backend shared by LFM2, LFM2-MoE and ZAYA1."""

    def __init__(self, pool: StatePool, device: torch.device, extra_state: str | None = None):
        self.pool = pool
        self.device = device
        self.extra_state = extra_state  # name of the second per-layer state, if the model has one
        self.num_resolutions = 0  # NOTE: tests count this to prove once-per-step resolution
        self._step: StepTensors | None = None
        self._group_steps: tuple[StepTensors, ...] = ()
        # The one builder of step inputs: eager steps and the graph runner's buckets share it.
        page_size = pool.kv_spec.page_size if pool.kv_spec else 1
        self.inputs = StepInputs(page_size, device, max(1, len(pool.kv_specs)))
        self.scratch = StepScratch()

    def begin_step(self, plan: StepPlan) -> StepTensors:
        step = self.inputs.build(plan)
        self.bind(step)
        return step

    def bind(self, step: StepTensors) -> None:
        """Make `step` the current step (graph replay binds its bucket's step here)."""
        self.num_resolutions += 1
        self._step = step
        # Each sliding-window group's view of the step: the same tensors but its own KV indices
        # (the same buffer objects on every replay, so a captured graph reads them in place).
        self._group_steps = (step,) + tuple(
            replace(step, slot_mapping=w.slot_mapping, block_tables=w.block_tables)
            for w in step.windows
        )
        self.scratch.new_step()

    @property
    def step(self) -> StepTensors:
        if self._step is None:
            raise RuntimeError("no step bound: call begin_step(plan) before the forward")
        return self._step

    def conv_state_metadata(self, layer_id: int) -> ShortConvMetadata:
        step = self.step
        extra = self.pool.state(self.extra_state, layer_id) if self.extra_state else None
        return ShortConvMetadata(
            conv_state=self.pool.state("conv", layer_id),
            cache_indices=step.cache_indices,
            query_start_loc=step.query_start_loc,
            has_initial_state=step.has_initial_state,
            is_decode=step.is_decode,
            step=step,
            extra_state=extra,
        )

    def attention_metadata(self, layer_id: int) -> AttentionMetadata:
        k, v = self.pool.kv(layer_id)
        group = self.pool.kv_group_of(layer_id)
        step = self.step  # raises when no step is bound
        return AttentionMetadata(
            k_cache=k,
            v_cache=v,
            step=self._group_steps[group] if group else step,
            scratch=self.scratch,
            window=self.pool.kv_specs[group].window,
        )
