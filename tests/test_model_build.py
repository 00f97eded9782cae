"""ModelRunner builds its model directly in the serving dtype (no fp32 transient)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shortconv.config import EngineConfig, ModelConfig
from shortconv.parallel import SINGLE
from shortconv.runner import ModelRunner
from shortconv.tools.make_tiny import make_tiny_checkpoint
from shortconv.worker_spec import Capacity, WorkerSpec


@pytest.mark.parametrize("arch", ["lfm2", "zaya1"])
def test_runner_allocates_weights_in_the_target_dtype(
    arch: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_tiny_checkpoint(arch, tmp_path, seed=3)
    seen: list[tuple[torch.dtype, int]] = []
    real_to = nn.Module.to

    def spy(self: nn.Module, *args: Any, **kw: Any) -> nn.Module:
        if not seen:  # the first cast after construction: what was allocated before it
            seen.extend((p.dtype, p.numel()) for p in self.parameters())
        return real_to(self, *args, **kw)

    monkeypatch.setattr(nn.Module, "to", spy)
    cfg = ModelConfig.from_dir(path)
    cap = Capacity(num_slots=3, num_pages=9)
    spec = WorkerSpec(
        path, cfg, EngineConfig(max_num_seqs=2), cap, torch.bfloat16, torch.device("cpu"), 32
    )
    runner = ModelRunner(spec, SINGLE)
    total = sum(n for _, n in seen)
    fp32 = sum(n for d, n in seen if d == torch.float32)
    assert total and fp32 / total < 0.05, (fp32, total)
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in runner.model.parameters())
    assert torch.get_default_dtype() == torch.float32
