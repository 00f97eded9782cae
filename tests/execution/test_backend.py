"""The per-step resolver runs once per step, however many layers read it (extend and decode)."""

from __future__ import annotations

import pytest
import torch

import shortconv.execution.backend as backend_mod
from shortconv.configs.config import EngineConfig
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=3)
    # Graphs on explicitly (CPU defaults to eager): decode must refresh the static buffers once.
    return build_engine(path, dtype="float32", engine_config=EngineConfig(enable_graphs=True))


def test_resolution_once_per_step(engine, monkeypatch):
    runner = engine.executor.runner
    backend = runner.backend
    builds, conv_calls, attn_calls = [], [], []
    # One builder: eager steps build from the step inputs; decode steps replay a captured
    # graph whose bucket is refreshed in those same inputs instead.
    inputs = backend.inputs
    assert runner.graphs.inputs is inputs
    real_build, real_refresh = inputs.build, inputs.refresh
    monkeypatch.setattr(inputs, "build", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    monkeypatch.setattr(
        inputs, "refresh", lambda *a, **k: builds.append(2) or real_refresh(*a, **k)
    )
    real_conv, real_attn = backend.conv_state_metadata, backend.attention_metadata
    monkeypatch.setattr(
        backend, "conv_state_metadata", lambda i: conv_calls.append(i) or real_conv(i)
    )
    monkeypatch.setattr(
        backend, "attention_metadata", lambda i: attn_calls.append(i) or real_attn(i)
    )
    cfg = engine.model_cfg
    n_conv = sum(t == "conv" for t in cfg.layer_types)
    n_attn = sum(t == "attention" for t in cfg.layer_types)
    engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3))
    engine.add_request([9, 10], SamplingParams(temperature=0.0, max_tokens=3))
    for phase in ("extend", "decode", "decode"):
        before = backend.num_resolutions
        builds.clear(), conv_calls.clear(), attn_calls.clear()
        engine.step()
        assert backend.num_resolutions - before == 1, phase
        assert builds == ([2] if phase == "decode" else [1]), phase
        assert sorted(conv_calls) == sorted(i for i, t in enumerate(cfg.layer_types) if t == "conv")
        assert len(conv_calls) == n_conv and len(attn_calls) == n_attn
        assert backend.step.is_decode == (phase == "decode")
        assert conv_calls  # the layers read the resolved step, not per-layer copies


def test_metadata_contract_types(engine):
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1))
    engine.step()
    backend = engine.executor.runner.backend
    layer = engine.model_cfg.conv_layer_ids[0]
    md = backend.conv_state_metadata(layer)
    assert md.cache_indices.dtype == torch.int64
    assert md.query_start_loc.dtype == torch.int32 and md.query_start_loc.shape == (2,)
    assert md.has_initial_state.dtype == torch.bool
    assert md.conv_state.data_ptr() == backend.pool.state("conv", layer).data_ptr()


def test_incomplete_backend_refused_at_construction():
    class Partial(backend_mod.BaseStateBackend):
        def begin_step(self, plan):  # noqa: ANN001, ANN202
            return None

    with pytest.raises(TypeError, match="abstract"):
        Partial()
