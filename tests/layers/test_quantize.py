"""`quantization="int8"` through the engine: which weights change, what start-up refuses, the
teacher-forced quality it keeps (and loses with wrong scales), and batch invariance."""

from __future__ import annotations

import re
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from shortconv.configs.config import ModelConfig
from shortconv.configs.support import check_quantization
from shortconv.errors import ConfigError
from shortconv.kernels.cpu_gemm import Q8Weight
from shortconv.layers import quantize as quantize_mod
from shortconv.layers.linear import LinearBase
from shortconv.layers.vocab import LMHead
from shortconv.llm import LLM
from shortconv.metrics.recorder import serve_metrics
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import quant_quality  # noqa: E402

# Measured on the tiny checkpoints (seed 0, 1024 teacher-forced positions, AMD EPYC): mean KL
# and top-1 agreement LFM2 6.1e-3 / 93.6%, LFM2-MoE 1.5e-2 / 95.0%, ZAYA1 6.3e-3 / 97.9%, with
# q8 weights (one scale per 32 weights; one scale per row measured 7.4e-3 / 1.5e-2 / 6.9e-3).
# These random models move that much under any rounding: bf16 instead of fp32 measured KL
# 3.4e-3 on the tiny LFM2. The bounds leave ~1.5x; scales 10% off fail them by far.
# NOTE: the quantization issue's 1e-3 / 99% is not met on these models.
BOUNDS = {"lfm2": (9e-3, 0.92), "lfm2_moe": (2.2e-2, 0.93), "zaya1": (9.5e-3, 0.96)}
POSITIONS = 1024


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: make_tiny_checkpoint(
            arch, tmp_path_factory.mktemp(arch), seed=0, with_tokenizer=False
        )
        for arch in ("lfm2", "lfm2_moe", "zaya1")
    }


def _quality(path: Path) -> quant_quality.Quality:
    return quant_quality.measure(path, "int8", POSITIONS, length=256)


@pytest.mark.parametrize("arch", sorted(BOUNDS))
def test_int8_keeps_the_teacher_forced_distributions(ckpts: dict[str, Path], arch: str) -> None:
    q = _quality(ckpts[arch])
    max_kl, min_top1 = BOUNDS[arch]
    assert q.positions == POSITIONS
    assert q.mean_kl <= max_kl and q.top1_agreement >= min_top1, q


@pytest.mark.parametrize("arch", sorted(BOUNDS))
def test_wrong_scales_fail_the_quality_bound(
    ckpts: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = quantize_mod.quantize_q8

    def off_by_a_tenth(weight: torch.Tensor) -> Q8Weight:
        qw = real(weight)
        return Q8Weight(qw.q, qw.scale * 1.1)

    monkeypatch.setattr(quantize_mod, "quantize_q8", off_by_a_tenth)
    q = _quality(ckpts[arch])
    max_kl, min_top1 = BOUNDS[arch]
    assert q.mean_kl > max_kl and q.top1_agreement < min_top1, q


def test_only_the_projections_are_quantized_and_their_float_copy_goes(
    ckpts: dict[str, Path],
) -> None:
    plain = quant_quality.runner_for(ckpts["lfm2"], "none", 64)
    quant = quant_quality.runner_for(ckpts["lfm2"], "int8", 64)
    layers = [m for m in quant.model.modules() if isinstance(m, LinearBase)]
    assert any(m.q8 is not None for m in layers)
    for m in layers:
        if isinstance(m, LMHead):  # tied to the embedding: stays float
            assert m.q8 is None and m.method.name != "q8"
            assert m.weight.dtype == torch.float32 and m.weight.numel()
        else:
            assert m.method.name == "q8" and m.q8 is not None and m.weight.numel() == 0
    before, after = plain.weight_bytes, quant.weight_bytes
    assert set(before) == {"float32"} and set(after) == {"float32", "int8"}
    moved = before["float32"] - after["float32"]  # the projections' fp32 bytes
    assert after["int8"] < moved / 3.5  # a byte a weight, plus 4 bytes per 32 weights


def test_the_lm_head_is_quantized_when_asked_and_the_tied_embedding_stays(
    ckpts: dict[str, Path],
) -> None:
    body = quant_quality.runner_for(ckpts["lfm2"], "int8", 64)
    both = quant_quality.runner_for(ckpts["lfm2"], "int8", 64, quantize_lm_head=True)
    head = both.model.lm_head
    assert isinstance(head, LMHead) and head.q8 is not None
    emb = both.model.embed_tokens.weight
    assert head.weight is emb and emb.numel() and emb.dtype == torch.float32  # lookups
    added = both.weight_bytes["int8"] - body.weight_bytes["int8"]
    assert added == head.q8.nbytes == emb.numel() * (1 + 4 / 32)
    assert both.weight_bytes["float32"] == body.weight_bytes["float32"]
    q = quant_quality.measure(ckpts["lfm2"], "int8", POSITIONS, length=256, quantize_lm_head=True)
    max_kl, min_top1 = BOUNDS["lfm2"]
    assert q.mean_kl <= max_kl and q.top1_agreement >= min_top1, q


def test_a_request_gets_the_same_tokens_alone_or_in_a_batch(ckpts: dict[str, Path]) -> None:
    llm = LLM(ckpts["lfm2"], dtype="float32", quantization="int8")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 13, 20, 33], [7, 8, 40, 41, 42, 43, 44, 45, 46, 47], [100, 3], [11] * 30]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=greedy)[0] for p in prompts]
    batch = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    llm.shutdown()


@pytest.mark.parametrize(
    ("method", "device", "arch", "message"),
    [
        ("int4", "cpu", "lfm2", "not implemented yet"),
        ("fp8", "cpu", "lfm2", "not implemented yet"),
        ("int8", "cuda", "lfm2", "CPU only"),
        ("int8", "cpu", "lfm2_vl", "vision tower"),
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
    assert got == {"float32": want["float32"], "bfloat16": 0, "float16": 0, "int8": want["int8"]}
