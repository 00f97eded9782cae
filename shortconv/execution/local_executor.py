"""tp_size=1 in this process: no Ray, no torch.distributed.

`step_messages=True` sends the plan through the step message (`StepDelta`) and a persistent
batch as TP ranks get it (tests, and the message's size at TP 1). Off by default: in process
nothing crosses, and encode + apply cost about 2 ms a 32-row step in Python
(docs/serving_path.md), more than the plan they would replace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from shortconv.engine.delta_encoder import StepDeltaEncoder
from shortconv.engine.executor import BaseExecutor, ExecutorError
from shortconv.engine.plan import StepPlan, StepResult
from shortconv.engine.stats import GraphStats
from shortconv.engine.step_delta import StepDelta
from shortconv.execution.parallel import SINGLE
from shortconv.execution.persistent_batch import PersistentBatch
from shortconv.execution.runner import ModelRunner
from shortconv.execution.state_io import gather_state, scatter_state
from shortconv.execution.worker_spec import WorkerSpec
from shortconv.lora.adapter import LoraAdapter


class LocalExecutor(BaseExecutor):
    tp_size = 1

    def __init__(self, spec: WorkerSpec, step_messages: bool = False) -> None:
        self.runner: ModelRunner | None = ModelRunner(spec, SINGLE)
        self.encoder, self.batch = StepDeltaEncoder(), PersistentBatch()
        self.step_messages = step_messages
        self.last_message: StepDelta | None = None  # the latest step's message (tests, benches)

    def execute(self, plan: StepPlan) -> StepResult:
        if self.runner is None:
            raise ExecutorError("executor is shut down")
        if self.step_messages:
            self.last_message = self.encoder.encode(plan)
            plan = self.batch.apply(self.last_message)
        result = self.runner.execute(plan)
        assert result is not None  # rank 0 always answers
        return result

    def check_health(self) -> None:
        if self.runner is None:
            raise ExecutorError("executor is shut down")

    def shutdown(self) -> None:
        self.runner = None

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        self._runner().load_lora(slot, adapter)

    def unload_lora(self, slot: int) -> None:
        self._runner().unload_lora(slot)

    def read_state(
        self, slots: Sequence[int], pages: Sequence[Sequence[int]]
    ) -> dict[str, torch.Tensor]:
        return gather_state(self._runner().pool, slots, pages)

    def write_state(
        self,
        slots: Sequence[int],
        pages: Sequence[Sequence[int]],
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        scatter_state(self._runner().pool, slots, pages, tensors)

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise ExecutorError("executor is shut down")
        return self.runner

    def state_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        return [self.runner.state_shapes()] if self.runner else []

    def weight_bytes(self) -> dict[str, int]:
        return dict(self.runner.weight_bytes) if self.runner is not None else {}

    def startup_phases(self) -> dict[str, float]:
        return dict(self.runner.startup_s) if self.runner is not None else {}

    def graph_stats(self) -> GraphStats | None:
        graphs = self.runner.graphs if self.runner is not None else None
        return graphs.stats() if graphs is not None else None
