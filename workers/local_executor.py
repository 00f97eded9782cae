"""tp_size=1 in this process: no Ray, no torch.distributed."""

from __future__ import annotations

from pathlib import Path

import torch

from shortconv.config import EngineConfig, ModelConfig
from shortconv.executor import BaseExecutor, ExecutorError
from shortconv.parallel import SINGLE
from shortconv.plan import StepPlan, StepResult
from shortconv.runner import Capacity, ModelRunner


class LocalExecutor(BaseExecutor):
    tp_size = 1

    def __init__(
        self,
        model_dir: str | Path,
        model_cfg: ModelConfig,
        engine_cfg: EngineConfig,
        capacity: Capacity,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.runner: ModelRunner | None = ModelRunner(
            model_dir, model_cfg, engine_cfg, capacity, dtype, device, SINGLE
        )

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

    def state_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        return [self.runner.state_shapes()] if self.runner else []
