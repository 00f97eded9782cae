"""The speculation switch-off policy (engine.spec_policy): by batch size per step, by recent
acceptance per request (a pause, and an adaptive k), and a request's own opt-out; the config
keys are checked at start-up.
Lossless with the policy at work: tests/engine/test_spec_decode.py's oracle, reused below."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from shortconv.configs.speculative import SpeculativeConfig
from shortconv.engine.request import Request
from shortconv.engine.spec_policy import AcceptanceTracker, observe, paid_k, step_allows
from shortconv.engine.speculation import Speculator
from shortconv.errors import ConfigError
from shortconv.sampling.sampling_params import SamplingParams
from tests.engine.test_spec_decode import GREEDY, MORE_PROMPTS, PROMPTS, engine, make_ckpt, run

CFG = SpeculativeConfig(
    num_speculative_tokens=4,
    disable_by_batch_size=2,
    min_acceptance_rate=0.25,
    acceptance_backoff_steps=3,
)
FIXED_K = replace(CFG, adaptive_k=False)


def _request(**kw: object) -> Request:
    params = SamplingParams(max_tokens=100, **kw)  # type: ignore[arg-type]
    return Request("r", [1, 2, 3], params, seed=0, output_token_ids=[4])


def test_batch_size_switch() -> None:
    spec, req = Speculator(CFG), _request()
    assert spec.limit(req, 64, 1000, num_running=2) == 4
    assert spec.limit(req, 64, 1000, num_running=3) == 0
    assert step_allows(SpeculativeConfig(disable_by_batch_size=None), 10_000)


def test_low_acceptance_pauses_then_probes_again() -> None:
    spec, req = Speculator(CFG), _request()
    draft, miss = (7, 7, 7, 7), (8, 8, 8, 8)
    rates = []
    for _ in range(10):  # every proposal rejected: the average falls below 0.25
        spec.accept(req, draft, miss)
        rates.append(req.spec_acceptance.rate)
        if spec.limit(req, 64, 1000) == 0:
            break
    assert rates[:-1] == sorted(rates[:-1], reverse=True) and rates[-2] >= 0.25
    assert len(rates) == 4  # 1 -> 0.7 -> 0.49 -> 0.343 -> 0.24: paused at the fourth
    limits = []
    for _ in range(4):
        spec.prepare([req], 64, 1000)  # the next step
        limits += [spec.limit(req, 64, 1000), spec.limit(req, 64, 1000)]  # pure: asked twice
    # 3 steps out, then a probe: of one proposal, the only position it has ever seen kept
    assert limits == [0, 0, 0, 0, 0, 0, 1, 1]
    spec.accept(req, draft, miss)  # a poor probe pauses it at once
    spec.prepare([req], 64, 1000)
    assert spec.limit(req, 64, 1000) == 0


def test_good_acceptance_keeps_proposing() -> None:
    spec, req = Speculator(FIXED_K), _request()
    for _ in range(50):
        spec.accept(req, (7, 7, 7, 7), (7, 8, 8, 8))  # one in four kept: at the bar
    spec.prepare([req], 64, 1000)
    assert spec.limit(req, 64, 1000) == 4


def test_adaptive_k_proposes_mostly_what_is_kept() -> None:
    """Only the first proposal is ever kept: k drops to 1 and re-probes the second position
    now and then (a row of one kept proposal is a weak guess that the next would be)."""
    spec, req = Speculator(CFG), _request()
    ks = []
    for _ in range(50):
        k = spec.limit(req, 64, 1000)
        ks.append(k)
        spec.accept(req, (7,) * k, (7, 8, 8, 8)[:k])
    assert set(ks) == {1, 4}
    assert ks[:5] == [4, 4, 4, 4, 1] and ks.count(1) > ks.count(4), ks


def test_adaptive_k_shrinks_on_a_rejected_tail_and_grows_back() -> None:
    spec, req = Speculator(CFG), _request()
    ks = []
    for _ in range(5):  # the first two proposals kept, the third rejected: 1 -> 0.7 -> ... 0.24
        k = spec.limit(req, 64, 1000)
        ks.append(k)
        spec.accept(req, (7,) * k, (7, 7, 8, 8)[:k])
    assert ks == [4, 4, 4, 4, 2]  # position 2's chance fell below the 0.25 bar at the fourth
    assert req.spec_acceptance.rate > CFG.min_acceptance_rate  # half kept: never paused
    for _ in range(3):  # rows that keep all they propose: position 2 comes back at 0.5
        assert spec.limit(req, 64, 1000) == 2
        spec.accept(req, (7, 7), (7, 7))
    assert spec.limit(req, 64, 1000) == 4


@pytest.mark.parametrize(
    ("rates", "k_before", "k_after"),
    [
        ([1.0, 1.0, 1.0, 1.0], 4, 4),
        ([0.6, 0.6, 0.6, 0.6], 4, 2),  # 0.6, 0.36, 0.216: under the 0.25 bar at position 2
        ([0.5, 0.5, 0.9, 1.0], 4, 2),  # 0.25 at position 1: at the bar is enough
        ([0.5, 0.5, 1.0, 1.0], 4, 4),
        ([0.1, 1.0, 1.0, 1.0], 4, 1),  # never 0: pausing is the other switch's call
        ([0.8, 0.8, 0.7, 0.7], 1, 2),  # past the current k the bar doubles: 0.64, then 0.448
        ([0.7, 0.7, 0.7, 0.7], 1, 1),  # 0.49 < 0.5
    ],
)
def test_k_is_set_by_a_product_of_conditional_rates(
    rates: list[float], k_before: int, k_after: int
) -> None:
    """Position i is proposed while the chance that it adds a token (the product of the
    per-position rates up to it) is at least the bar; never fewer than one."""
    assert paid_k(CFG, AcceptanceTracker(position_rates=rates, k=k_before)) == k_after


def test_zero_bar_keeps_every_position() -> None:
    never = SpeculativeConfig(min_acceptance_rate=0.0, num_speculative_tokens=3)
    assert paid_k(never, AcceptanceTracker(position_rates=[0.0, 0.0, 0.0])) == 3


def test_unreached_positions_learn_nothing() -> None:
    t = AcceptanceTracker()
    observe(CFG, t, 4, 1, step=1)  # kept 0, rejected 1, never reached 2 and 3
    assert t.position_rates == [1.0, 0.7, 1.0, 1.0]
    observe(CFG, t, 1, 1, step=2)  # kept it: position 1, not proposed, counts as a third kept
    assert t.position_rates == [1.0, pytest.approx(0.73), 1.0, 1.0]


def test_observe_ignores_empty_rows() -> None:
    t = AcceptanceTracker()
    observe(CFG, t, 0, 0, step=5)
    assert t == AcceptanceTracker()


def test_request_opt_out() -> None:
    spec = Speculator(CFG)
    assert spec.limit(_request(speculative=False), 64, 1000) == 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"disable_by_batch_size": 0}, "disable_by_batch_size must be an integer >= 1"),
        ({"min_acceptance_rate": 1.5}, r"min_acceptance_rate must be a number in \[0, 1\]"),
        ({"min_acceptance_rate": "low"}, "min_acceptance_rate must be a number"),
        ({"acceptance_backoff_steps": 0}, "acceptance_backoff_steps must be an integer >= 1"),
        ({"adaptive_k": "yes"}, r"adaptive_k must be a bool \(true or false\), got 'yes'"),
        ({"adaptive_k": 1}, "adaptive_k must be a bool"),
    ],
)
def test_config_keys_refused_with_the_reason(value: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(value)


def test_lossless_with_switch_off_at_work(tmp_path: Path) -> None:
    """Batch-size and acceptance switches on: same tokens as speculation off, and verify rows
    only in steps with at most `disable_by_batch_size` running requests."""
    ckpt = make_ckpt("lfm2", tmp_path)
    spec = {
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "disable_by_batch_size": 1,
        "min_acceptance_rate": 0.3,
        "acceptance_backoff_steps": 2,
    }
    short = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 8)]
    params = [GREEDY, *short]  # the first runs alone once the others end
    prompts = [MORE_PROMPTS[1], *PROMPTS[1:]]  # the first both keeps and rejects proposals
    off = run(engine(ckpt, None), prompts, params)
    on_eng = engine(ckpt, spec)
    on = run(on_eng, prompts, params)
    assert [o.token_ids for o in on.outputs] == [o.token_ids for o in off.outputs]
    verify_steps = [p for p in on.plans if any(s.num_draft for s in p.seqs)]
    assert verify_steps, "nothing speculated: the test proves nothing"
    assert all(len(p.seqs) == 1 for p in verify_steps)
    stats = on_eng.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_lossless_while_adaptive_k_moves(tmp_path: Path) -> None:
    """Adaptive k with a high bar, so k moves within requests: the same tokens as speculation
    off, and k both shrank and grew (seen by each row's k as the planner asks). On LFM2: this
    checkpoint's proposals are rejected often enough at one position and kept at the next."""
    ckpt = make_ckpt("lfm2", tmp_path)
    spec: dict[str, object] = {
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "min_acceptance_rate": 0.6,
    }
    prompts, params = [*MORE_PROMPTS, *PROMPTS], replace(GREEDY, max_tokens=80)
    off = run(engine(ckpt, None), prompts, params)
    on_eng = engine(ckpt, spec)
    speculator = on_eng.scheduler.speculator
    ks: dict[int, list[int]] = {}  # by request (its tracker): k each time it was asked
    k_for = speculator._k_for

    def recording(cfg: SpeculativeConfig, tracker: AcceptanceTracker) -> int:
        k = k_for(cfg, tracker)
        ks.setdefault(id(tracker), []).append(k)
        return k

    speculator._k_for = recording
    on = run(on_eng, prompts, params)
    assert [o.token_ids for o in on.outputs] == [o.token_ids for o in off.outputs]
    steps = [list(zip(seq, seq[1:], strict=False)) for seq in ks.values()]
    moved = [pairs for pairs in steps if any(a > b for a, b in pairs)]
    assert moved, ks  # some request's k shrank ...
    assert any(any(a < b for a, b in pairs) for pairs in moved), ks  # ... and grew
    stats = on_eng.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
