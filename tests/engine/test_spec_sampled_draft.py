"""Sampled draft proposals (temperature > 0) verified by rejection sampling: the output follows
the target's distribution, and seeds stay reproducible.

Oracle for the distribution: the exact p of the first, second and third generated tokens,
computed from the target's logits by transformers (every continuation of the prompt scored
in one forward), against the engine's empirical counts over 20,000 seeded requests, by a
chi-square test. The draft is another architecture (q != p), so rejections are frequent and
the residual max(0, p - q) matters: resampling rejected positions from p fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shortconv.engine.llm_engine import LLMEngine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.truncate import truncated_checkpoint
from tests.engine.test_spec_decode import PROMPTS, engine, make_ckpt, run, spec_counts

PROMPT = [5, 9, 13, 6, 2]
NUM_DRAWS = 20_000
VOCAB = 16
P_VALUE_FLOOR = 1e-3  # the seeds are fixed: the statistic is the same on every run


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("spec_sampled")
    found = {arch: make_ckpt(arch, base / arch) for arch in ("lfm2", "zaya1")}
    # q close enough to p that proposals are both accepted and rejected (zaya1's q is far
    # from lfm2's p: it is almost always rejected)
    found["lfm2_cut"] = truncated_checkpoint(found["lfm2"], 2, base / "lfm2_cut")
    return found


def draft_spec(draft: Path, k: int = 2) -> dict[str, object]:
    return {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": k,
        "disable_by_batch_size": None,  # the batch is large; speculate anyway
        "min_acceptance_rate": 0.0,
    }


def exact_marginals(ckpt: Path) -> list[torch.Tensor]:
    """p of generated tokens 1, 2 and 3 at temperature 1, from transformers' logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (t1, t2)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        probs = model(ids).logits[:, len(PROMPT) - 1 :].double().softmax(dim=-1)
    p1 = probs[0, 0]
    p2_given = probs[::VOCAB, 1]  # [t1, t2]
    p3_given = probs[:, 2].view(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    joint12 = p1[:, None] * p2_given
    return [p1, joint12.sum(0), (joint12[..., None] * p3_given).sum((0, 1))]


def sample_many(eng: LLMEngine, num: int, n: int = 1) -> torch.Tensor:
    """[num, 3]: the three tokens of `num` draws at temperature 1: `num / n` requests seeded
    0, 1, ..., each with n forks. NOTE: a fork's second token is a plain decode step, so at
    max_tokens 3 a fork never verifies: keep n = 1 here."""
    params = [
        SamplingParams(temperature=1.0, seed=i, n=n, max_tokens=3, ignore_eos=True)
        for i in range(num // n)
    ]
    ids = [eng.add_request(PROMPT, p) for p in params]
    done: dict[tuple[str, int], list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id, out.index] = list(out.token_ids)
    return torch.tensor([done[r, i] for r in ids for i in range(n)])


def chi_square_p_value(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(statistic, p-value) of counts against p; bins expecting < 5 are pooled."""
    expected = p * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return stat, float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_sampled_draft_tokens_follow_the_target_distribution(ckpts: dict[str, Path]) -> None:
    # NOTE: all the requests in one batch. The cost is per step, not per token (a step of
    # this tiny model is mostly fixed overhead: scheduling, ~40 small ops per layer, three
    # forwards with the draft's catch-up and proposals), and 20,000 requests in waves of 256
    # took ~600 steps (~165 s on a loaded machine); one wave takes a handful (~45 s).
    kw = {"max_num_seqs": NUM_DRAWS, "max_num_batched_tokens": NUM_DRAWS * (len(PROMPT) + 3)}
    eng = engine(ckpts["lfm2"], draft_spec(ckpts["lfm2_cut"]), **kw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: more threads only contend (20x slower on 2 cores)
    try:
        tokens = sample_many(eng, NUM_DRAWS)
    finally:
        torch.set_num_threads(threads)
    proposed, accepted = spec_counts(eng)
    # Most second tokens went through a verify, and many proposals were rejected: the
    # residual was drawn often enough for the test to see it.
    assert proposed >= NUM_DRAWS, proposed
    assert 0.1 * proposed < accepted < 0.9 * proposed, (proposed, accepted)
    for pos, p in enumerate(exact_marginals(ckpts["lfm2"])):
        counts = torch.bincount(tokens[:, pos], minlength=VOCAB)
        stat, p_value = chi_square_p_value(counts, p)
        assert p_value > P_VALUE_FLOOR, (pos, stat, p_value)


def test_same_seed_same_output_with_a_sampled_draft(ckpts: dict[str, Path]) -> None:
    params = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)
    ]
    runs = [
        run(engine(ckpts["lfm2"], draft_spec(ckpts["zaya1"], 3)), PROMPTS, params) for _ in range(2)
    ]
    a, b = ([o.token_ids for o in r.outputs] for r in runs)
    assert a == b
    assert len({tuple(t) for t in a}) == 3
    # The rows were verified against the draft's q (rejection sampling), not one-hot.
    assert any(s.draft_probs is not None for plan in runs[0].plans for s in plan.seqs)


def test_seeded_requests_with_speculation_off_are_unaffected(ckpts: dict[str, Path]) -> None:
    params = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=30, ignore_eos=True, speculative=False)
        for s in (1, 2, 3)
    ]
    ref = run(engine(ckpts["lfm2"], None), PROMPTS, params)
    ours = run(engine(ckpts["lfm2"], draft_spec(ckpts["zaya1"], 3)), PROMPTS, params)
    assert [o.token_ids for o in ours.outputs] == [o.token_ids for o in ref.outputs]
    assert all(not s.num_draft for plan in ours.plans for s in plan.seqs)
