"""The early-exit draft pair (`shortconv.tiny.early_exit`): a target damped past its first
layers and that target cut to them. The pair's weights are what they claim (checked against the
source checkpoint's tensors), the cut target loads and drafts losslessly (the oracle: the same
engine with speculation off), and on a 512-token vocabulary, where chance agreement is rare,
the damping is what makes the draft accept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shortconv.configs.config import EngineConfig
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint
from shortconv.tiny.early_exit import damped_checkpoint, early_exit_pair
from shortconv.tiny.truncate import layer_index
from tests.engine.test_spec_decode import (
    Run,
    assert_nothing_held,
    assert_same,
    run,
    spec_counts,
)

CUT = 3  # of the tiny LFM2's 6 layers: conv, conv, attention
PROMPTS = [[7 + (i * m) % 400 for i in range(12)] for m in (3, 17, 101)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("ee") / "src", {}, seed=3)


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return {k: v for shard in ckpt.glob("*.safetensors") for k, v in load_file(shard).items()}


def test_pair_weights(source: Path, tmp_path: Path) -> None:
    target, draft = early_exit_pair(source, CUT, 0.25, tmp_path)
    src, tgt, dft = tensors(source), tensors(target), tensors(draft)
    assert tgt.keys() == src.keys()
    damped = [
        k for k in src if (layer_index(k) or 0) >= CUT and k.split(".")[-2] in ("w2", "out_proj")
    ]
    assert len(damped) == 2 * (6 - CUT)  # each deep layer: its operator's out_proj and w2
    for key, value in src.items():
        want = value * 0.25 if key in damped else value
        assert torch.equal(tgt[key], want), key
    # the draft: every non-layer tensor and the first CUT layers, exactly the target's
    assert dft.keys() == {k for k in tgt if (layer_index(k) or 0) < CUT}
    assert "model.embed_tokens.weight" in dft and "model.layers.2.self_attn.q_proj.weight" in dft
    for key, value in dft.items():
        assert torch.equal(value, tgt[key]), key
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["num_hidden_layers"] == CUT and len(cfg["layer_types"]) == CUT


def _draft_run(target: Path, draft: Path | None) -> tuple[Run, float]:
    spec = None
    if draft is not None:
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
        spec |= {"min_acceptance_rate": 0.0, "adaptive_k": False}
    eng = build_engine(
        target,
        dtype="float32",
        engine_config=EngineConfig(speculative_config=spec, kv_page_size=4),  # type: ignore[arg-type]
    )
    out = run(eng, PROMPTS, GREEDY)
    proposed, accepted = spec_counts(eng)
    assert_nothing_held(eng)
    return out, accepted / proposed if proposed else 0.0


def test_lossless_and_accepts_when_damped(source: Path, tmp_path: Path) -> None:
    target, draft = early_exit_pair(source, CUT, 0.1, tmp_path / "damped")
    ref, _ = _draft_run(target, None)
    ours, acceptance = _draft_run(target, draft)
    assert_same(ours, ref)
    # undamped, the same cut accepts by chance only
    plain_target, plain_draft = early_exit_pair(source, CUT, 1.0, tmp_path / "plain")
    _, plain_acceptance = _draft_run(plain_target, plain_draft)
    assert acceptance >= 0.5 > 0.2 >= plain_acceptance, (acceptance, plain_acceptance)


def test_bad_input_is_refused_before_writing(source: Path, tmp_path: Path) -> None:
    for first in (0, 6):
        with pytest.raises(ValueError, match="first_layers must be in 1..5"):
            damped_checkpoint(source, first, 0.1, tmp_path / "out")
    zaya = make_tiny_checkpoint("zaya1", tmp_path / "zaya", {}, seed=0)
    with pytest.raises(ValueError, match="not 'zaya'"):
        damped_checkpoint(zaya, 1, 0.1, tmp_path / "out")
    assert not (tmp_path / "out").exists()
