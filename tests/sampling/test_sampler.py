"""Sampler behaviour on CPU: greedy, seeded draws, truncation, logprobs, dtypes, transfers."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from shortconv.sampling.sampler import Sampler, SamplerOutput, SamplingRow, draw_seed
from shortconv.sampling.sampling_params import SamplingParams

SAMPLER = Sampler()


def row(seed: int = 0, step: int = 0, **kw: Any) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), seed, step)


def draws(logits_1d: torch.Tensor, n: int, seed: int = 7, **kw: Any) -> list[int]:
    """n draws from one distribution in one call, one distinct step per row."""
    logits = logits_1d.unsqueeze(0).expand(n, -1)
    return SAMPLER(logits, [row(seed, s, **kw) for s in range(n)]).token_ids


class _Calls(TorchFunctionMode):
    """Records the torch functions/methods called, to count device->host transfers."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


_TRANSFERS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"}


def test_greedy_equals_argmax_and_ties_take_first_index() -> None:
    logits = torch.randn(5, 97, generator=torch.Generator().manual_seed(0))
    logits[2, 10] = logits[2, 40] = logits[2].max() + 1.0
    out = SAMPLER(logits, [row(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[2] == 10
    assert out.logprobs == [None] * 5 and out.top_logprobs == [None] * 5


def test_greedy_fast_path_is_one_argmax_and_one_transfer() -> None:
    logits = torch.randn(4, 33)
    with _Calls() as calls:
        SAMPLER(logits, [row(temperature=0.0), row(top_k=1)] * 2)
    compute = [n for n in calls.names if n not in {"dim", "__get__"}]
    assert compute == ["argmax", "tolist"]


def test_general_path_has_one_transfer() -> None:
    logits = torch.randn(4, 50)
    rows = [
        row(temperature=0.0, logprobs=2),
        row(1, 0, top_k=5, top_p=0.8, min_p=0.05, logprobs=3),
        row(2, 3, temperature=0.5),
        row(3, 1, logprobs=0),
    ]
    with _Calls() as calls:
        SAMPLER(logits, rows)
    assert sum(n in _TRANSFERS for n in calls.names) == 1


def test_seeded_sampling_reproducible_and_batch_independent() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    alone = SAMPLER(logits, [row(seed=42, step=3)]).token_ids[0]
    # Same (seed, step) at another batch position, next to other requests, gives the same token.
    batch = torch.cat([torch.randn(2, 1000), logits, torch.randn(1, 1000)])
    rows = [row(1, 0), row(temperature=0.0), row(42, 3), row(5, 9, top_p=0.5)]
    assert SAMPLER(batch, rows).token_ids[2] == alone
    assert SAMPLER(logits, [row(seed=42, step=3)]).token_ids[0] == alone


def test_different_steps_and_seeds_draw_differently() -> None:
    flat = torch.zeros(1000)
    by_step = draws(flat, 20, seed=3)
    assert len(set(by_step)) > 10
    by_seed = SAMPLER(flat.expand(20, -1), [row(s, 0) for s in range(20)]).token_ids
    assert len(set(by_seed)) > 10
    assert by_seed != by_step


def test_draw_seed_is_fixed_63_bit_and_mixes() -> None:
    seeds = {draw_seed(s, t) for s in (-1, 0, 1, 2**63 + 5) for t in range(50)}
    assert len(seeds) == 200
    assert draw_seed(2**64 + 3, 1) == draw_seed(3, 1)  # seeds are taken mod 2**64
    assert all(0 <= v < 2**63 for v in seeds)
    assert draw_seed(5, 7) == draw_seed(5, 7)
    assert draw_seed(5, 7) != draw_seed(6, 6)  # no seed+step collisions


def test_top_k_one_equals_greedy_and_top_k_limits_support() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    out = SAMPLER(logits, [row(s, s, top_k=1, temperature=1.5) for s in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    one = logits[0]
    allowed = set(one.topk(3).indices.tolist())
    got = set(draws(one, 600, temperature=3.0, top_k=3))
    assert got == allowed


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = torch.tensor([1.0, 1.2, 0.9, 1.1])  # top token only ~29% of the mass
    assert set(draws(logits, 300, top_p=0.01)) == {1}


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert set(draws(logits, 400, top_p=0.75)) == {0, 1}
    assert set(draws(logits, 400, top_p=0.85)) == {0, 1, 2}


def test_min_p_filters_relative_to_max() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # threshold 0.2 * 0.5 = 0.1 drops only the 0.05 token
    assert set(draws(logits, 600, min_p=0.2)) == {0, 1, 2}
    assert set(draws(logits, 100, min_p=1.0)) == {0}


@pytest.mark.parametrize("temperature", [1e-4, 1e-30, 1e-45, 1e-300])
def test_temperature_to_zero_approaches_greedy(temperature: float) -> None:
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    out = SAMPLER(logits, [row(s, s, temperature=temperature) for s in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()


def _assert_matches(tokens: list[int], probs: torch.Tensor, tol: float) -> None:
    counts = Counter(tokens)
    for i, p in enumerate(probs.tolist()):
        assert abs(counts[i] / len(tokens) - p) < tol, (i, counts[i] / len(tokens), p)


def test_empirical_distribution_matches_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 4000  # std of a frequency <= 0.008; tol 0.035 is > 4 sigma
    _assert_matches(draws(logits, n), logits.softmax(-1), 0.035)
    _assert_matches(draws(logits, n, seed=11, temperature=0.5), (logits / 0.5).softmax(-1), 0.035)


def test_truncated_distribution_is_renormalised() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, 0.0, 0.0])
    expect = torch.zeros(6)
    expect[:3] = logits[:3].softmax(-1)
    _assert_matches(draws(logits, 3000, top_k=3), expect, 0.035)


@pytest.mark.parametrize(
    ("kw", "kept"),
    [
        (dict(top_k=5), {0, 1, 2, 3, 4}),
        (dict(top_p=0.25), {0, 1, 2}),  # head probs ~.110, .100, .090: mass .21 then .30
        (dict(min_p=0.5), {0, 1, 2, 3, 4}),  # tail ~.0003 < .5 * .11; head >= .07
        (dict(top_k=50, top_p=0.4, min_p=0.01), {0, 1}),  # top-50 renormalised: .235, .213
    ],
)
def test_truncation_never_samples_a_filtered_token(kw: dict[str, Any], kept: set[int]) -> None:
    # Five head tokens hold ~45% of the mass and 2000 tail tokens the rest, so any leak in the
    # filtering would show up within thousands of draws.
    logits = torch.zeros(2005)
    logits[:5] = torch.tensor([6.0, 5.9, 5.8, 5.7, 5.6])
    assert set(draws(logits, 2000, **kw)) == kept


def test_logprobs_are_raw_log_softmax_at_chosen_token() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4)) * 3
    rows = [
        row(1, 0, temperature=0.7, top_k=10, logprobs=0),
        row(temperature=0.0, logprobs=0),
        row(2, 5),
    ]
    out = SAMPLER(logits, rows)
    raw = torch.log_softmax(logits.float(), -1)
    for i in (0, 1):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        assert out.top_logprobs[i] is None
    assert out.logprobs[2] is None and out.top_logprobs[2] is None


def test_top_logprobs_sorted_and_correct() -> None:
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(5))
    out = SAMPLER(logits, [row(0, 0, logprobs=5), row(1, 0, temperature=0.0, logprobs=2)])
    raw = torch.log_softmax(logits, -1)
    for i, k in ((0, 5), (1, 2)):
        top = out.top_logprobs[i]
        assert top is not None and len(top) == k
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)
        assert [t for t, _ in top] == raw[i].topk(k).indices.tolist()
        for t, v in top:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-6)
    assert out.top_logprobs[1][0][0] == out.token_ids[1]  # greedy pick is the top logprob


def test_top_logprobs_capped_at_vocab() -> None:
    out = SAMPLER(torch.randn(1, 3), [row(logprobs=20)])
    assert len(out.top_logprobs[0]) == 3


def test_mixed_batch_of_greedy_and_random_rows() -> None:
    logits = torch.randn(6, 80, generator=torch.Generator().manual_seed(6))
    rows = [
        row(temperature=0.0),
        row(1, 2, top_p=0.9),
        row(temperature=0.0, logprobs=1),
        row(3, 4, min_p=0.1, logprobs=0),
        row(5, 6, top_k=7, temperature=2.0),
        row(top_k=1),
    ]
    out = SAMPLER(logits, rows)
    argmax = logits.argmax(-1).tolist()
    for i in (0, 2, 5):
        assert out.token_ids[i] == argmax[i]
    for i in (1, 3, 4):  # each random row draws what it would draw alone
        assert out.token_ids[i] == SAMPLER(logits[i : i + 1], [rows[i]]).token_ids[0]
    assert [lp is None for lp in out.logprobs] == [True, True, False, False, True, True]
    assert out.top_logprobs[2] is not None and out.top_logprobs[3] is None


def test_bf16_logits() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    greedy = SAMPLER(logits, [row(temperature=0.0)] * 4)
    assert greedy.token_ids == logits.float().argmax(-1).tolist()
    rows = [
        row(0, 0, logprobs=3),
        row(temperature=0.0, logprobs=0),
        row(1, 1, top_p=0.5),
        row(2, 2, top_k=4, min_p=0.1),
    ]
    out = SAMPLER(logits, rows)
    assert isinstance(out, SamplerOutput) and all(0 <= t < 64 for t in out.token_ids)
    assert out.token_ids == SAMPLER(logits.float(), rows).token_ids
    raw = torch.log_softmax(logits.float(), -1)
    assert out.logprobs[0] == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-6)
    assert all(isinstance(v, float) and math.isfinite(v) for _, v in out.top_logprobs[0])


def test_shape_mismatch_and_empty_batch() -> None:
    with pytest.raises(ValueError, match="logits"):
        SAMPLER(torch.randn(2, 5), [row()])
    with pytest.raises(ValueError, match="logits"):
        SAMPLER(torch.randn(5), [row()])
    assert SAMPLER(torch.empty(0, 5), []) == SamplerOutput([], [], [])
