"""tp_size=1 in this process: no Ray, no torch.distributed."""

from __future__ import annotations

from shortconv.engine.executor import BaseExecutor, ExecutorError
from shortconv.engine.plan import StepPlan, StepResult
from shortconv.engine.stats import GraphStats
from shortconv.execution.parallel import SINGLE
from shortconv.execution.runner import ModelRunner
from shortconv.execution.worker_spec import WorkerSpec
from shortconv.lora.adapter import LoraAdapter


class LocalExecutor(BaseExecutor):
    tp_size = 1

    def __init__(self, spec: WorkerSpec) -> None:
        self.runner: ModelRunner | None = ModelRunner(spec, SINGLE)

    def execute(self, plan: StepPlan) -> StepResult:
        if self.runner is None:
            raise ExecutorError("executor is shut down")
        result = self.runner.execute(plan)
        assert result is not None  # rank 0 always answers
        return result

    def check_health(self) -> None:
        if self.runner is None:
            raise ExecutorError("executor is shut down")

    def shutdown(self) -> None:
        self.runner = None

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        if self.runner is None:
            raise ExecutorError("executor is shut down")
        self.runner.load_lora(slot, adapter)

    def state_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        return [self.runner.state_shapes()] if self.runner else []

    def weight_bytes(self) -> dict[str, int]:
        return dict(self.runner.weight_bytes) if self.runner is not None else {}

    def startup_phases(self) -> dict[str, float]:
        return dict(self.runner.startup_s) if self.runner is not None else {}

    def graph_stats(self) -> GraphStats | None:
        graphs = self.runner.graphs if self.runner is not None else None
        return graphs.stats() if graphs is not None else None
