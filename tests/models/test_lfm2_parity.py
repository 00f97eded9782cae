"""Greedy parity with transformers (fp32, CPU) for LFM2 and LFM2-MoE tiny random configs."""

from __future__ import annotations

import random
import zlib

import pytest
from oracle import assert_matches_oracle, oracle_greedy
from transformers import AutoModelForCausalLM

from shortconv import LLM, SamplingParams
from shortconv.configs.config import EngineConfig
from shortconv.llm import build_engine
from shortconv.tiny.checkpoint import make_tiny_checkpoint

CONFIGS = {
    "lfm2-base": ("lfm2", {}),
    "lfm2-L4-bias": (
        "lfm2",
        {
            "hidden_size": 48,
            "conv_L_cache": 4,
            "conv_bias": True,
            "num_key_value_heads": 1,
            "num_attention_heads": 4,
            "num_hidden_layers": 4,
            "layer_types": ["full_attention", "conv", "conv", "full_attention"],
        },
    ),
    "lfm2-mha-wide": (
        "lfm2",
        {
            "hidden_size": 96,
            "num_attention_heads": 6,
            "num_key_value_heads": 6,
            "num_hidden_layers": 3,
            "layer_types": ["conv", "full_attention", "conv"],
            "block_auto_adjust_ff_dim": True,
            "block_multiple_of": 32,
            "intermediate_size": 200,
        },
    ),
    "moe-base": ("lfm2_moe", {}),
    "moe-top1-L4": (
        "lfm2_moe",
        {
            "num_experts": 6,
            "num_experts_per_tok": 1,
            "conv_L_cache": 4,
            "conv_bias": True,
            "num_dense_layers": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.7,
            "num_hidden_layers": 4,
            "layer_types": ["conv", "conv", "full_attention", "conv"],
        },
    ),
    "moe-top3-nobias": (
        "lfm2_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "use_expert_bias": False,
            "num_key_value_heads": 4,
            "num_dense_layers": 0,
        },
    ),
}
LENGTHS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 64]
MAX_NEW = 10


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_case(request, tmp_path_factory):
    arch, overrides = CONFIGS[request.param]
    path = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(request.param), overrides, seed=7)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    rng = random.Random(zlib.crc32(request.param.encode()))
    prompts = [[rng.randrange(0, 512) for _ in range(n)] for n in LENGTHS]
    refs = [oracle_greedy(hf, p, MAX_NEW) for p in prompts]
    return request.param, path, prompts, refs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("budget", [512, 7])
def test_batched_parity(model_case, budget):
    """All prompt lengths in one batch; budget=7 forces chunked prefill mixed with decode."""
    name, path, prompts, refs = model_case
    llm = LLM(model=path, dtype="float32", max_num_batched_tokens=budget)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for p, o, r in zip(prompts, outs, refs, strict=True):
        assert_matches_oracle(o.token_ids, r, f"{name} len={len(p)} budget={budget}")


def test_requests_join_mid_run(model_case):
    name, path, prompts, refs = model_case
    eng = build_engine(path, dtype="float32", engine_config=EngineConfig(max_num_batched_tokens=24))
    done: dict[str, list[int]] = {}
    ids: dict[str, int] = {}
    pending = list(range(len(prompts)))
    steps = 0
    while pending or eng.has_unfinished():
        # One new request every other step: joins land mid-prefill and mid-decode of others.
        if pending and steps % 2 == 0:
            i = pending.pop(0)
            ids[eng.add_request(prompts[i], GREEDY)] = i
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        steps += 1
    assert len(done) == len(prompts)
    for rid, toks in done.items():
        i = ids[rid]
        assert_matches_oracle(toks, refs[i], f"{name} joined len={len(prompts[i])}")
