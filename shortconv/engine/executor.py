"""Executor boundary: the engine hands a StepPlan to every rank and gets rank 0's result back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from shortconv.engine.plan import StepPlan, StepResult
from shortconv.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from shortconv.engine.stats import GraphStats, StartupReport
    from shortconv.lora.adapter import LoraAdapter


class ExecutorError(RuntimeError):
    """A worker failed or died; the engine fails the step's requests with this message."""


class BaseExecutor(ABC):
    tp_size: int = 1

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    @abstractmethod
    def check_health(self) -> None:
        """Raise ExecutorError when a worker is gone."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def read_state(
        self, slots: Sequence[int], pages: Sequence[Sequence[int]]
    ) -> dict[str, torch.Tensor]:
        """Host copies of checkpoints' state (one slot each) (`execution.state_io.gather_state`)."""
        raise NotImplementedError(f"{type(self).__name__} does not export state")

    def write_state(
        self,
        slots: Sequence[int],
        pages: Sequence[Sequence[int]],
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        """Write checkpoints' state (`execution.state_io.scatter_state`); ValueError, and
        nothing written, when a shape does not fit."""
        raise NotImplementedError(f"{type(self).__name__} does not import state")

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Write a LoRA adapter into slot `slot` on every rank (LoraError where it does not
        fit the model)."""
        raise ConfigError(f"{type(self).__name__} does not load LoRA adapters yet")

    def unload_lora(self, slot: int) -> None:
        """Empty LoRA slot `slot` on every rank."""
        raise ConfigError(f"{type(self).__name__} does not load LoRA adapters yet")

    def state_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per rank: the shapes of its state tensors (tests assert each rank holds a shard)."""
        return []

    def weight_bytes(self) -> dict[str, int]:
        """Rank 0's weight bytes by storage dtype (`layers.quantize.weight_bytes`), read once
        at start-up; empty where the executor cannot say."""
        return {}

    def startup_phases(self) -> dict[str, float]:
        """The in-process model's start-up phases (seconds each, in order); empty where the
        model runs in other processes, whose `startup_reports` say."""
        return {}

    def startup_reports(self) -> list[StartupReport]:
        """Each TP rank process's start-up report (rank order); empty with no such process."""
        return []

    def graph_stats(self) -> GraphStats | None:
        """The graph runner's counters where it runs in this process; None otherwise."""
        return None
