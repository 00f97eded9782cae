"""The fp32 kernel choice by rows: with a row threshold taken from an injected table, a bound
layer runs our tile up to the threshold and torch's linear above it, bit for bit each path's
own output (the two round differently, so the output says which path ran), and both equal
the float64 reference within fp32 rounding."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from graph_helpers import make_runner
from oracle import assert_matches_oracle, oracle_greedy
from torch import nn

from shortconv.configs.config import EngineConfig
from shortconv.errors import ConfigError
from shortconv.execution import runner as runner_mod
from shortconv.kernels import cpu_gemm as cg
from shortconv.layers.linear import ReplicatedLinear
from shortconv.layers.linear_binding import LinearPolicy, bind_linear_methods, linear_layers
from shortconv.layers.linear_cpu_gemm import CpuGemmLinear
from shortconv.layers.linear_float import OneDnnLinear, cpu_float_method
from shortconv.layers.linear_rows import MEASURED_TILE_ROWS, fp32_tile_rows
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import build_hf_model, make_tiny_checkpoint

FAKE_TABLE = {"avx512": 3, "avx2": 5}
# (in, out): a weight large enough for oneDNN (torch's path from 1M weights) and a small one
# that torch serves with F.linear.
SHAPES = [(1024, 1024), (96, 64)]

needs_kernels = pytest.mark.skipif(
    not (cg.cpu_has_avx2_fma() and (shutil.which("c++") or shutil.which("g++"))),
    reason="needs an AVX2/FMA CPU and a C++ compiler",
)


def _bound_layer(in_f: int, out_f: int, max_rows: int) -> ReplicatedLinear:
    g = torch.Generator().manual_seed(in_f + out_f)
    layer = ReplicatedLinear(in_f, out_f, bias=True).requires_grad_(False)
    layer.weight.copy_(torch.randn(out_f, in_f, generator=g) / in_f**0.5)
    assert layer.bias is not None
    layer.bias.copy_(torch.randn(out_f, generator=g))
    holder = nn.Sequential(layer)
    bind_linear_methods(holder, LinearPolicy(cpu_gemm=True, cpu_gemm_max_rows=max_rows))
    layer.method.process_after_load(layer)
    return layer


@needs_kernels
@pytest.mark.parametrize(("in_f", "out_f"), SHAPES)
@pytest.mark.parametrize("isa", sorted(FAKE_TABLE))
def test_tile_serves_up_to_the_table_threshold_and_torch_above(
    in_f: int, out_f: int, isa: str
) -> None:
    assert cg.load() is None
    threshold = fp32_tile_rows(isa, FAKE_TABLE)
    layer = _bound_layer(in_f, out_f, threshold)
    method = layer.method
    assert isinstance(method, CpuGemmLinear) and method.max_rows == threshold
    assert method.larger == cpu_float_method(layer.weight, prepack=False)
    w, b = layer.weight, layer.bias
    assert b is not None
    g = torch.Generator().manual_seed(7)
    for rows in range(1, threshold + 4):
        x = torch.randn(rows, in_f, generator=g)
        tile = cg.gemm_f32(x, w, b)
        torch_path = method.larger.apply(layer, x, b)
        # NOTE: the paths must differ on this input, or the check below could not tell them
        # apart.
        assert not torch.equal(tile, torch_path), f"{rows} rows: the paths agree bit for bit"
        want = tile if rows <= threshold else torch_path
        got = layer(x)
        assert torch.equal(got, want), f"{rows} rows took the wrong path (threshold {threshold})"
        ref = (x.double() @ w.double().T + b.double()).float()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        # A [batch, seq, in] input counts its rows the same way.
        assert torch.equal(layer(x.view(1, rows, in_f)), want.view(1, rows, out_f))


@needs_kernels
def test_large_weights_above_the_threshold_run_on_onednn() -> None:
    """The 1024x1024 case above compares against torch's oneDNN path, not F.linear."""
    layer = _bound_layer(1024, 1024, 3)
    assert isinstance(layer.method, CpuGemmLinear)
    assert isinstance(layer.method.larger, OneDnnLinear) and layer.method.larger.plain


def test_every_tile_set_the_kernels_name_has_a_measured_threshold() -> None:
    for isa in ("avx2", "avx512", "avx512vnni"):
        assert fp32_tile_rows(isa) == MEASURED_TILE_ROWS[isa] > 0


def test_a_tile_set_the_table_lacks_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"tile set 'avx512'.*measured: \['avx2'\]"):
        fp32_tile_rows("avx512", {"avx2": 64})


@needs_kernels
def test_the_runner_binds_the_tables_threshold_and_logs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Start-up reads the threshold for this CPU's tile set from the table (injected here) and
    binds it into every fp32 layer's method; the log says which rows go where."""
    assert cg.load() is None
    isa = cg.set_isa()
    table = {isa: 2}
    monkeypatch.setattr(runner_mod, "fp32_tile_rows", lambda i: fp32_tile_rows(i, table))
    path = make_tiny_checkpoint("lfm2", tmp_path, seed=0)
    with caplog.at_level(logging.INFO, logger=runner_mod.log.name):
        runner = make_runner(path, enable_graphs=False)
    methods = {layer.method for _, layer in linear_layers(runner.model)}
    assert methods and all(isinstance(m, CpuGemmLinear) and m.max_rows == 2 for m in methods)
    assert f"fp32 linear layers up to 2 rows (the {isa} tile set's" in caplog.text


@needs_kernels
def test_greedy_tokens_equal_the_oracle_on_both_sides_of_the_threshold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny LFM2 with a threshold of 2 rows (injected table): prefill chunks and the 4-, 3-row
    decode steps run torch's linear, the 2- and 1-row ones our tile, as the requests finish one
    after another; every request's greedy tokens equal transformers'."""
    assert cg.load() is None
    monkeypatch.setattr(runner_mod, "fp32_tile_rows", lambda i: fp32_tile_rows(i, {i: 2}))
    hf = build_hf_model("lfm2", {}, seed=13)
    hf.save_pretrained(str(tmp_path))
    eng = build_engine(tmp_path, dtype="float32", engine_config=EngineConfig(max_num_seqs=4))
    prompts = [[11, 7, 300, 42, 5], [99, 123, 8], [17, 64, 3, 250, 9, 1], [2, 30]]
    ids = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True)
        ids[eng.add_request(prompt, params)] = i
    done: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.error is None, out.error
            if out.finished:
                done[ids[out.request_id]] = list(out.token_ids)
    assert sorted(done) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        ref = oracle_greedy(hf, prompt, 4 + 3 * i)
        assert_matches_oracle(done[i], ref, f"request {i}")
