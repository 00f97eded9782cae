"""End-to-end sampling through LLM.generate: seeds, stop strings, logprobs, text prompts."""

from __future__ import annotations

import pytest
import torch

from shortconv import LLM, SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=5)
    return LLM(model=path, dtype="float32", seed=0)


PROMPTS = [[5, 9, 13], [7, 8], list(range(30, 50))]


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    p = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True
    )
    a = llm.generate(prompt_token_ids=PROMPTS, sampling_params=p)
    b = llm.generate(prompt_token_ids=PROMPTS[::-1], sampling_params=p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b[::-1]]
    c = llm.generate(
        prompt_token_ids=PROMPTS,
        sampling_params=SamplingParams(temperature=0.9, seed=99, max_tokens=12, ignore_eos=True),
    )
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_max_tokens_and_finish_reason(llm):
    out = llm.generate(
        prompt_token_ids=[[5, 6]],
        sampling_params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    )[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_logprobs_are_raw_model_logprobs(llm):
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
    out = llm.generate(prompt_token_ids=[[5, 9, 13]], sampling_params=p)[0]
    assert len(out.logprobs) == 3 and len(out.top_logprobs) == 3
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-6  # greedy picks the top-1
        assert lp <= 0 and [x[1] for x in top] == sorted((x[1] for x in top), reverse=True)
        assert abs(sum(torch.tensor([x[1] for x in top]).exp().tolist())) <= 1.0 + 1e-5


def test_text_prompts_and_stop_strings(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = llm.generate(prompts=["Hello there"], sampling_params=greedy)[0]
    assert full.text and len(full.token_ids) == 16
    stop = full.text[3:5]
    cut = llm.generate(
        prompts=["Hello there"],
        sampling_params=SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]
        ),
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    # Nothing is held but the prefix cache's checkpoints and pages (evictable at any time).
    s = llm.engine.stats()
    assert (s.slots_used, s.kv_pages_used) == (s.prefix_cache_checkpoints, s.prefix_cache_pages)


def test_stop_token_ids(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    full = llm.generate(prompt_token_ids=[[5, 9, 13]], sampling_params=greedy)[0]
    target = full.token_ids[3]
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[target])
    out = llm.generate(prompt_token_ids=[[5, 9, 13]], sampling_params=p)[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(target) + 1]
    assert out.finish_reason == "stop"
