"""ModelRunner builds its model directly in the serving dtype (no fp32 transient)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shortconv.cache.kv_groups import kv_groups
from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.execution.parallel import SINGLE
from shortconv.execution.runner import ModelRunner
from shortconv.execution.worker_spec import Capacity, WorkerSpec, plan_worker_spec
from shortconv.tiny.checkpoint import make_tiny_checkpoint


@pytest.mark.parametrize("arch", ["lfm2", "lfm3", "zaya1"])
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
    windows = (9,) * (len(kv_groups(cfg)) - 1)  # LFM3's sliding-window group has its own pool
    cap = Capacity(num_slots=3, num_pages=9, window_pages=windows)
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


def test_graph_buckets_follow_the_kv_capped_max_model_len(tmp_path) -> None:
    """A KV pool smaller than the model's context caps the engine's max_model_len, and the
    captured decode graphs stop there: no bucket a sequence can never reach."""
    path = make_tiny_checkpoint("lfm2", tmp_path, seed=3)
    eng = EngineConfig(
        max_num_seqs=2,
        kv_page_size=16,
        num_kv_pages=9,  # page 0 is scratch: 8 pages = 128 tokens per sequence at most
        enable_graphs=True,
        graph_batch_sizes=(1,),
        graph_context_sizes=(64, 256, 512),
    )
    spec = plan_worker_spec(path, eng, "float32")
    assert ModelConfig.from_dir(path).max_model_len > 128
    assert spec.max_model_len == 128
    runner = ModelRunner(spec, SINGLE)
    assert runner.graphs is not None and runner.graphs.context_sizes == (64, 128)
