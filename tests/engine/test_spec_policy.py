"""The speculation switch-off policy (engine.spec_policy): by batch size per step, by recent
acceptance per request, and a request's own opt-out; the config keys are checked at start-up.
Lossless with the policy at work: tests/engine/test_spec_decode.py's oracle, reused below."""

from __future__ import annotations

from pathlib import Path

import pytest

from shortconv.configs.speculative import SpeculativeConfig
from shortconv.engine.request import Request
from shortconv.engine.spec_policy import AcceptanceTracker, observe, step_allows
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
    assert limits == [0, 0, 0, 0, 0, 0, 4, 4]  # 3 steps out, then a probe
    spec.accept(req, draft, miss)  # a poor probe pauses it at once
    spec.prepare([req], 64, 1000)
    assert spec.limit(req, 64, 1000) == 0


def test_good_acceptance_keeps_proposing() -> None:
    spec, req = Speculator(CFG), _request()
    for _ in range(50):
        spec.accept(req, (7, 7, 7, 7), (7, 8, 8, 8))  # one in four kept: at the bar
    spec.prepare([req], 64, 1000)
    assert spec.limit(req, 64, 1000) == 4


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
