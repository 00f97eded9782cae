"""Prepacked (oneDNN-blocked) CPU linear weights: same results, used only where they apply, never
stale; and greedy parity with transformers when every linear of a model goes through them."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_matches_oracle, oracle_greedy
from transformers import AutoModelForCausalLM

from shortconv import LLM, SamplingParams
from shortconv.execution.parallel import ParallelContext
from shortconv.layers import linear as linear_mod
from shortconv.layers import linear_float
from shortconv.layers.linear import ColumnParallelLinear
from shortconv.layers.linear_float import OneDnnLinear, pack_weight

pytestmark = pytest.mark.skipif(not linear_float.HAS_ONEDNN, reason="torch built without oneDNN")


def _layer(out_f: int, in_f: int, seed: int, bias: bool = True) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(in_f, out_f, bias, ParallelContext())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=g) / 16)
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(out_f, generator=g))
    return layer.requires_grad_(False).eval()


def _prepack(layer: ColumnParallelLinear) -> None:
    """Bind the layer as the engine does with prepack_cpu_weights, and run its load hook."""
    layer.method = linear_float.cpu_float_method(layer.weight, prepack=True)
    assert isinstance(layer.method, OneDnnLinear) and layer.method.prepack
    layer.method.process_after_load(layer)


def test_packed_layer_equals_f_linear_for_every_row_count() -> None:
    layer = _layer(1024, linear_float.ONEDNN_MIN_WEIGHT // 1024, seed=1)
    _prepack(layer)
    assert layer.blocked is not None
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for rows in (1, linear_float.PACKED_MIN_ROWS - 1, linear_float.PACKED_MIN_ROWS, 33, 130):
            x = torch.randn(rows, layer.weight.shape[1], generator=g)
            want = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("size", [linear_float.PACK_MIN_WEIGHT, linear_float.ONEDNN_MIN_WEIGHT])
def test_packed_copy_is_what_runs_from_the_row_threshold(size: int) -> None:
    """Poison the blocked copy (a zero weight): rows below the threshold must not see it, rows
    at and above it must; for a mid-size weight (plain oneDNN not used) as for a large one."""
    layer = _layer(1024, size // 1024, seed=3)
    _prepack(layer)
    zero = pack_weight(torch.zeros_like(layer.weight))
    assert zero is not None
    layer.blocked = linear_float.PackedWeight(zero.tensor, layer.weight._version)
    with torch.inference_mode():
        few = torch.randn(linear_float.PACKED_MIN_ROWS - 1, layer.weight.shape[1])
        many = torch.randn(linear_float.PACKED_MIN_ROWS, layer.weight.shape[1])
        assert not torch.allclose(layer(few), layer.bias.expand(few.shape[0], -1))
        torch.testing.assert_close(layer(many), layer.bias.expand(many.shape[0], -1))


def test_an_in_place_weight_change_retires_the_packed_copy() -> None:
    layer = _layer(1024, linear_float.ONEDNN_MIN_WEIGHT // 1024, seed=4)
    _prepack(layer)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # bumps the version counter the copy was made at
    x = torch.randn(16, layer.weight.shape[1])
    with torch.inference_mode():
        torch.testing.assert_close(
            layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4
        )


def test_packing_applies_only_to_large_fp32_cpu_weights() -> None:
    big = linear_float.PACK_MIN_WEIGHT
    assert pack_weight(torch.randn(big // 64, 64)) is not None
    assert pack_weight(torch.randn(big // 64 - 1, 64)) is None  # too small to pay
    assert pack_weight(torch.randn(big // 64, 64, dtype=torch.bfloat16)) is None
    with torch.inference_mode():
        inference = torch.randn(big // 64, 64)
    assert pack_weight(inference) is None  # no version counter to guard it


def test_fused_swiglu_with_packed_weights() -> None:
    g = torch.Generator().manual_seed(5)
    hidden, inter = 256, linear_float.ONEDNN_MIN_WEIGHT // 256
    gate, up = (_layer(inter, hidden, seed, bias=False) for seed in (5, 6))
    _prepack(gate)
    _prepack(up)
    for rows in (linear_float.PACKED_MIN_ROWS, linear_mod.FUSED_SWIGLU_MIN_ROWS):
        x = torch.randn(rows, hidden, generator=g)
        with torch.inference_mode():
            got = linear_mod.silu_mul(x, gate, up)
        want = F.silu(F.linear(x, gate.weight)) * F.linear(x, up.weight)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["lfm2", "zaya1"])
def test_greedy_parity_with_every_linear_packed(
    arch: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny model's weights are below the oneDNN size floors; lowering them sends every
    linear (LM head included) through the packed path, batches of 9 rows included."""
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(arch, tmp_path / arch, seed=11)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 4, 9, 17, 30, 2, 8, 12, 5)]
    refs = [oracle_greedy(hf, p, 8) for p in prompts]
    monkeypatch.setattr(linear_float, "ONEDNN_MIN_WEIGHT", 1 << 10)
    monkeypatch.setattr(linear_float, "PACK_MIN_WEIGHT", 1 << 10)
    llm = LLM(model=path, dtype="float32", max_num_batched_tokens=40, prepack_cpu_weights=True)
    runner = llm.engine.executor.runner
    packed = [m for m in runner.model.modules() if getattr(m, "blocked", None) is not None]
    assert len(packed) >= 4, "the lowered floor must put linears on the packed path"
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    )
    llm.shutdown()
    for p, o, r in zip(prompts, outs, refs, strict=True):
        assert_matches_oracle(o.token_ids, r, f"{arch} packed len={len(p)}")
