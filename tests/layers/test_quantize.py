"""`quantization="int8"` and `"int4"` through the engine: which weights change, what start-up
refuses, the teacher-forced quality each keeps (and loses with wrong scales), and batch
invariance."""

from __future__ import annotations

import re
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shortconv.configs.config import ModelConfig
from shortconv.configs.support import check_quantization
from shortconv.errors import ConfigError
from shortconv.kernels.cpu_gemm import Q8Weight
from shortconv.kernels.cpu_gemm_q4 import Q4Weight
from shortconv.kernels.cpu_gemm_q6 import Q6Weight
from shortconv.layers import quantize as quantize_mod
from shortconv.layers.int4_mix import q6_ffn_down
from shortconv.layers.linear_binding import linear_layers
from shortconv.layers.vocab import LMHead
from shortconv.llm import LLM
from shortconv.metrics.recorder import serve_metrics
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import quant_quality  # noqa: E402

# Measured on the tiny checkpoints (seed 0, 1024 teacher-forced positions), mean KL and top-1
# agreement against fp32. int8 (AMD EPYC): LFM2 6.1e-3 / 93.6%, LFM2-MoE 1.5e-2 / 95.0%, ZAYA1
# 6.3e-3 / 97.9%, with q8 weights (one scale per 32 weights; one scale per row measured 7.4e-3 /
# 1.5e-2 / 6.9e-3). int4 (Intel Xeon), q4 (scale + min per 32, least-squares fitted): LFM2
# 0.872 / 41.3%, LFM2-MoE 0.445 / 57.8%, ZAYA1 0.135 / 80.2% (the plain min/max mapping: 0.989
# / 41.7%, 0.491 / 52.8%, 0.155 / 82.0%); a symmetric 4-bit code (Q4_0-like: the largest magnitude
# maps to -8) measured 1.164 / 35.7% on LFM2; with int8 activations (the q4 tiles on AVX-512
# VNNI) 0.990 / 41.8%, 0.496 / 52.8%, 0.151 / 81.9%. These random models move that much under any
# rounding: bf16 instead of fp32 measured KL 3.4e-3 on the tiny LFM2, and 4-bit rounding is ~17x
# int8's per weight, so ~300x its KL. The bounds leave ~1.5x (int8) and ~1.3x (int4); the
# breakages below fail them by far.
# NOTE: the quantization issue's 1e-3 / 99% is not met on these models.
BOUNDS = {
    ("int8", "lfm2"): (9e-3, 0.92),
    ("int8", "lfm2_moe"): (2.2e-2, 0.93),
    ("int8", "zaya1"): (9.5e-3, 0.96),
    ("int4", "lfm2"): (1.15, 0.36),
    ("int4", "lfm2_moe"): (0.58, 0.45),
    ("int4", "zaya1"): (0.18, 0.75),
}
POSITIONS = 1024


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: make_tiny_checkpoint(
            arch, tmp_path_factory.mktemp(arch), seed=0, with_tokenizer=False
        )
        for arch in ("lfm2", "lfm2_moe", "zaya1")
    }


def _quality(path: Path, method: str) -> quant_quality.Quality:
    return quant_quality.measure(path, method, POSITIONS, length=256)


@pytest.mark.parametrize(("method", "arch"), sorted(BOUNDS))
def test_quantized_keeps_the_teacher_forced_distributions(
    ckpts: dict[str, Path], method: str, arch: str
) -> None:
    q = _quality(ckpts[arch], method)
    max_kl, min_top1 = BOUNDS[method, arch]
    assert q.positions == POSITIONS
    assert q.mean_kl <= max_kl and q.top1_agreement >= min_top1, q


def _q8_scales_off_by_a_tenth(qw: Q8Weight) -> Q8Weight:
    return Q8Weight(qw.q, qw.scale * 1.1)


def _q4_scales_doubled(qw: Q4Weight) -> Q4Weight:
    return Q4Weight(qw.q, qw.scale * 2, qw.min)


def _q4_groups_shifted(qw: Q4Weight) -> Q4Weight:
    # Each block's scale and min read from its neighbour's: a layout off by one group.
    return Q4Weight(qw.q, qw.scale.roll(1, dims=1), qw.min.roll(1, dims=1))


def _q6_groups_shifted(qw: Q6Weight) -> Q6Weight:
    # Under int4 only the LM head is q6: its blocks read their neighbour's scales. (Scaling
    # every head scale alike would only sharpen the softmax and keep each argmax.)
    return Q6Weight(qw.q, qw.scale.roll(1, dims=1))


# method: (the quantizer the method calls, a breakage of its output); int4's head is q6.
BREAKAGES = {
    "int8": [("quantize_q8", _q8_scales_off_by_a_tenth)],
    "int4": [
        ("quantize_q4", _q4_scales_doubled),
        ("quantize_q4", _q4_groups_shifted),
        ("quantize_q6", _q6_groups_shifted),
    ],
}


@pytest.mark.parametrize(
    ("method", "arch", "name", "broken"),
    [(m, a, *b) for m, a in sorted(BOUNDS) for b in BREAKAGES[m]],
)
def test_wrong_scales_fail_the_quality_bound(
    ckpts: dict[str, Path],
    method: str,
    arch: str,
    name: str,
    broken: Callable[[Any], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = getattr(quantize_mod, name)
    monkeypatch.setattr(quantize_mod, name, lambda weight: broken(real(weight)))
    q = _quality(ckpts[arch], method)
    max_kl, min_top1 = BOUNDS[method, arch]
    assert q.mean_kl > max_kl and q.top1_agreement < min_top1, q


# quantization: (the layer's slot and method name, bits a weight: codes + scale [+ min] / 32)
FORMATS = {"int8": ("q8", 8 + 1), "int4": ("q4", 4 + 1)}  # q4's scale and min are fp16
# The LM head: q8 under int8; q6 (6-bit codes + an fp16 scale per 32) under int4, with its
# bytes reported as "int6".
HEADS = {"int8": ("q8", "int8", 8 + 1), "int4": ("q6", "int6", 6.5)}


@pytest.mark.parametrize("method", sorted(FORMATS))
def test_the_projections_and_the_head_are_quantized_and_the_tied_embedding_stays(
    ckpts: dict[str, Path], method: str
) -> None:
    slot, bits = FORMATS[method]
    head_slot, head_key, head_bits = HEADS[method]
    plain = quant_quality.runner_for(ckpts["lfm2"], "none", 64)
    quant = quant_quality.runner_for(ckpts["lfm2"], method, 64)
    head = quant.model.lm_head
    assert isinstance(head, LMHead) and head.method.name == head_slot
    assert [s for s in ("q8", "q4", "q6") if getattr(head, s) is not None] == [head_slot]
    emb = quant.model.embed_tokens.weight
    assert head.weight is emb and emb.numel() and emb.dtype == torch.float32  # exact lookups
    head_bytes = getattr(head, head_slot).nbytes
    assert head_bytes == emb.numel() * head_bits / 8
    # Under int4, Q4_K_M's ffn_down layers are q6 too (layers.int4_mix): 6.5 bits a weight.
    layers = linear_layers(quant.model)
    picked = q6_ffn_down(n for n, _ in layers) if method == "int4" else frozenset()
    assert picked or method == "int8"
    q6_weights = 0
    for name, m in layers:
        if m is head:
            continue
        want_slot = "q6" if name in picked else slot
        assert m.method.name == want_slot and getattr(m, want_slot) is not None, name
        assert m.weight.numel() == 0
        q6_weights += m.q6.scale.numel() * 32 if m.q6 is not None else 0
    before, after = plain.weight_bytes, quant.weight_bytes
    assert set(before) == {"float32"} and set(after) == {"float32", head_key, method}
    moved = (before["float32"] - after["float32"]) // 4  # the projections' weights
    body_bytes = (moved - q6_weights) * bits // 8
    if method == "int8":
        assert after["int8"] == body_bytes + head_bytes
    else:
        assert after["int4"] == body_bytes and after["int6"] == head_bytes + q6_weights * 6.5 / 8


@pytest.mark.parametrize("method", sorted(FORMATS))
def test_quantize_lm_head_off_keeps_the_head_float(ckpts: dict[str, Path], method: str) -> None:
    both = quant_quality.runner_for(ckpts["lfm2"], method, 64)
    body = quant_quality.runner_for(ckpts["lfm2"], method, 64, quantize_lm_head=False)
    head = body.model.lm_head
    assert isinstance(head, LMHead) and head.q8 is None and head.q4 is None and head.q6 is None
    assert head.method.name == "cpu_gemm" and head.weight.numel()
    assert getattr(both.model.lm_head, HEADS[method][0]) is not None
    assert both.weight_bytes["float32"] == body.weight_bytes["float32"]  # the tied rows stay
    q = quant_quality.measure(ckpts["lfm2"], method, POSITIONS, length=256, quantize_lm_head=False)
    max_kl, min_top1 = BOUNDS[method, "lfm2"]
    assert q.mean_kl <= max_kl and q.top1_agreement >= min_top1, q


@pytest.mark.parametrize("method", sorted(FORMATS))
def test_a_request_gets_the_same_tokens_alone_or_in_a_batch(
    ckpts: dict[str, Path], method: str
) -> None:
    llm = LLM(ckpts["lfm2"], dtype="float32", quantization=method)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 13, 20, 33], [7, 8, 40, 41, 42, 43, 44, 45, 46, 47], [100, 3], [11] * 30]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=greedy)[0] for p in prompts]
    batch = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    llm.shutdown()


@pytest.mark.parametrize(
    ("method", "device", "arch", "message"),
    [
        ("fp8", "cpu", "lfm2", "not implemented yet"),
        ("int8", "cuda", "lfm2", "CPU only"),
        ("int8", "cpu", "lfm2_vl", "vision tower"),
        ("int4", "cuda", "lfm2", "CPU only"),
        ("int4", "cpu", "lfm3_vl", "vision tower"),
    ],
)
def test_unsupported_combinations_are_refused_at_start(
    method: str, device: str, arch: str, message: str, tmp_path: Path
) -> None:
    path = make_tiny_checkpoint(arch, tmp_path / arch, seed=0)
    cfg = ModelConfig.from_dir(path)
    with pytest.raises(ConfigError, match=message):
        check_quantization(method, cfg, torch.device(device))
    if device == "cpu":  # and through the engine, before any weight is read
        with pytest.raises(ConfigError, match=message):
            LLM(path, dtype="float32", quantization=method)


def test_weight_bytes_by_dtype_are_a_gauge(ckpts: dict[str, Path]) -> None:
    """The real exporter (prometheus_client over HTTP) reports rank 0's weights by dtype."""
    llm = LLM(ckpts["lfm2"], dtype="float32", quantization="int8")
    server = serve_metrics(llm)
    try:
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2))
        head = llm.engine.executor.runner.model.lm_head
        assert head.method.name == "q8"  # the engine's default quantizes the LM head
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.close()
        llm.shutdown()
    got = {
        dtype: float(v)
        for dtype, v in re.findall(r'^shortconv_weight_bytes\{dtype="(\w+)"\} (\S+)$', text, re.M)
    }
    want = llm.engine.weight_bytes
    assert set(want) == {"float32", "int8"} and want["int8"] > 0
    zeros = {"bfloat16": 0, "float16": 0, "int4": 0, "int6": 0}
    assert got == {"float32": want["float32"], "int8": want["int8"], **zeros}
