"""Logit controls (logit_bias, min_tokens, penalties) against a plain reference of the formulas
on a tiny model's logits, and through the real engine on a tiny checkpoint."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from shortconv import LLM, SamplingParams
from shortconv.sampling.grammar import GrammarSpec
from shortconv.sampling.logit_controls import apply_logit_controls
from shortconv.sampling.sampler import Sampler
from shortconv.sampling.sampling_row import SamplingRow, make_row
from shortconv.tiny.checkpoint import build_hf_model, make_tiny_checkpoint

EOS = (2,)


def reference(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The formulas, one row and one token at a time (OpenAI's penalties, vLLM's repetition
    penalty and min_tokens)."""
    out = logits.double().clone()
    for i, r in enumerate(rows):
        p = r.params
        for tok, bias in p.logit_bias:
            out[i, tok] += bias
        for tok in r.banned_token_ids:
            out[i, tok] = float("-inf")
        counts = Counter(r.output_token_ids)
        for tok in set(r.prompt_token_ids) | set(counts):
            v = out[i, tok].item()
            out[i, tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for tok, c in counts.items():
            out[i, tok] -= p.frequency_penalty * c + p.presence_penalty
    return out


@pytest.fixture(scope="module")
def model_logits() -> torch.Tensor:
    """Last-position logits of a tiny random LFM2 over 8 prompts."""
    model = build_hf_model("lfm2", seed=0).eval()
    ids = torch.randint(
        3, model.config.vocab_size, (8, 12), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        return model(input_ids=ids).logits[:, -1, :].float()


MIXED: list[dict[str, Any]] = [
    {},
    dict(presence_penalty=1.5),
    dict(frequency_penalty=-0.7),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6, frequency_penalty=0.4, presence_penalty=-1.0),
    dict(logit_bias={"5": 100, "11": -100, "40": 3.5}),
    dict(min_tokens=10, stop_token_ids=[7], logit_bias={"2": 50}),
    dict(logit_bias={"17": -4}, repetition_penalty=1.3, presence_penalty=2.0),
]


def _rows(vocab: int) -> list[SamplingRow]:
    rng = random.Random(3)
    rows = []
    for kw in MIXED:
        prompt = [rng.randrange(vocab) for _ in range(12)]
        # Repeats on purpose: frequency counts > 1, and tokens in both prompt and output.
        output = [rng.choice(prompt[:4] + [rng.randrange(vocab)]) for _ in range(rng.randrange(9))]
        rows.append(make_row(SamplingParams(max_tokens=32, **kw), 0, prompt, output, EOS))
    return rows


def test_controls_match_the_reference_formulas(model_logits: torch.Tensor) -> None:
    rows = _rows(model_logits.shape[1])
    got = apply_logit_controls(model_logits, rows)
    want = reference(model_logits, rows)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
    assert not torch.equal(got, model_logits)  # the controls changed something
    assert torch.equal(got[0], model_logits[0])  # a row asking for nothing is untouched
    greedy = [_greedy(r) for r in rows]
    assert Sampler()(model_logits, greedy).token_ids == want.argmax(-1).tolist()


def _greedy(r: SamplingRow) -> SamplingRow:
    params = dataclasses.replace(r.params, temperature=0.0)
    return dataclasses.replace(r, params=params)


def test_no_control_returns_the_logits_themselves(model_logits: torch.Tensor) -> None:
    rows = [make_row(SamplingParams(), 0, [1, 2], [3], EOS)] * model_logits.shape[0]
    assert apply_logit_controls(model_logits, rows) is model_logits
    assert rows[0].prompt_token_ids == rows[0].output_token_ids == ()  # plain rows carry none


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    p = SamplingParams(min_tokens=2, stop_token_ids=[9])
    assert make_row(p, 0, [1], [4], EOS).banned_token_ids == (2, 9)
    assert make_row(p, 0, [1], [4, 5], EOS).banned_token_ids == ()
    ignore = SamplingParams(min_tokens=2, ignore_eos=True)
    assert make_row(ignore, 0, [1], [], EOS).banned_token_ids == ()


# ---- through the engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    ckpt: Path = make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("controls"), seed=0)
    engine = LLM(model=ckpt, dtype="float32", seed=0, max_num_seqs=8)
    yield engine
    engine.shutdown()


PROMPT = [5, 9, 13, 21, 8]


def _one(llm: LLM, **kw: Any) -> Any:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **kw})
    return llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]


def test_a_plus_100_bias_forces_its_token_at_every_greedy_step(llm: LLM) -> None:
    plain = _one(llm)
    tok = next(t for t in range(50, 200) if t not in plain.token_ids)
    assert _one(llm, logit_bias={str(tok): 100}).token_ids == [tok] * 8


def test_a_minus_100_bias_on_the_greedy_token_changes_the_first_token(llm: LLM) -> None:
    plain = _one(llm, logprobs=2)
    first, runner_up = plain.token_ids[0], plain.top_logprobs[0][1][0]
    biased = _one(llm, logit_bias={str(first): -100}, logprobs=2)
    assert biased.token_ids[0] == runner_up != first
    # Logprobs stay those of the raw model: the biased-away token is still the most likely.
    assert biased.top_logprobs[0][0][0] == first


def test_min_tokens_holds_back_an_eos_the_bias_would_force(llm: LLM) -> None:
    eos = llm.engine.scheduler.cfg.eos_token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, logit_bias={eos: 100})
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 4 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:3]


def test_an_out_of_vocabulary_bias_is_refused_naming_logit_bias(llm: LLM) -> None:
    vocab = llm.engine.model_cfg.vocab_size
    with pytest.raises(ValueError, match="logit_bias") as info:
        _one(llm, logit_bias={vocab: 1.0})
    assert info.value.param == "logit_bias"  # type: ignore[attr-defined]


def test_penalties_change_a_greedy_run(llm: LLM) -> None:
    """A random model rarely repeats itself, so these reward repeats (< 1, negative)."""
    plain = _one(llm).token_ids
    rep = _one(llm, repetition_penalty=0.2).token_ids
    assert rep != plain and set(rep) <= set(PROMPT)  # boosted back into the prompt's tokens
    freq = _one(llm, frequency_penalty=-2.0).token_ids
    assert freq != plain and len(set(freq)) < len(freq)


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(llm: LLM) -> None:
    base = dict(max_tokens=10, ignore_eos=True)
    kinds = [
        SamplingParams(temperature=0.0, repetition_penalty=0.5, frequency_penalty=-1, **base),
        SamplingParams(temperature=0.9, seed=11, logit_bias={"30": 4.0, "31": -50}, **base),
        SamplingParams(
            temperature=0.0, max_tokens=60, presence_penalty=1.0, grammar=GrammarSpec.json_object()
        ),
        SamplingParams(temperature=0.0, **base),
        SamplingParams(temperature=0.8, seed=4, presence_penalty=-1.5, min_tokens=5, **base),
    ]
    prompts = [PROMPT, [7, 7, 7, 7], [40, 41, 42], PROMPT, [3, 99, 12, 12]]
    alone = [
        llm.generate(prompt_token_ids=[p], sampling_params=k)[0].token_ids
        for p, k in zip(prompts, kinds, strict=True)
    ]
    mixed = llm.generate(prompt_token_ids=prompts, sampling_params=kinds)
    assert [o.token_ids for o in mixed] == alone
    assert alone[0] != alone[3][: len(alone[0])]  # the penalties did something
