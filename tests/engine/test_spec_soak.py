"""A soak with speculation: many mixed requests (speculating and not, greedy and sampled, stops,
`max_tokens`, `n = 2` forks, aborts mid-run, preemption on a small page pool), n-gram and a
draft model; the requests that ran to the end equal speculation off, and afterwards every slot
(spec slots and prefix checkpoints included), KV page and draft slot and page is free."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from shortconv.engine.llm_engine import LLMEngine
from shortconv.sampling.sampling_params import SamplingParams
from tests.engine.test_spec_decode import SPEC, assert_nothing_held, engine, make_ckpt

BASE = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
KW = {"num_kv_pages": 24, "max_num_seqs": 6, "max_num_batched_tokens": 24}


def mixed(i: int) -> tuple[list[int], SamplingParams]:
    """Request i of the soak: a prompt of 5..18 tokens and one of six kinds of parameters."""
    prompt = [4 + (i * 5 + j * (i % 4 + 1)) % 12 for j in range(5 + (i * 7) % 14)]
    kinds = [
        BASE,
        replace(BASE, speculative=False),
        replace(BASE, max_tokens=3 + i % 9),
        replace(BASE, stop_token_ids=(4 + i % 12,)),
        SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=12, ignore_eos=True),
    ]
    return prompt, kinds[i % len(kinds)]


def soak(eng: LLMEngine, num: int = 24) -> dict[str, list[list[int]]]:
    """Add two requests a step, abort every fifth a few steps after it came; each finished
    request's forks' tokens, by request id (aborted ones absent)."""
    done: dict[str, dict[int, list[int]]] = {}
    added: list[tuple[int, str]] = []
    aborted: set[str] = set()
    step, i = 0, 0
    preempt, preempted = eng.scheduler._preempt, []
    eng.scheduler._preempt = lambda req: (preempted.append(req), preempt(req))[1]  # type: ignore[method-assign]
    while i < num or eng.has_unfinished():
        for _ in range(2 if i < num else 0):
            added.append((step, eng.add_request(*mixed(i), request_id=f"r{i}")))
            i += 1
        for when, rid in added:
            if int(rid[1:]) % 5 == 4 and step == when + 3 and rid not in done:
                eng.abort_request(rid)
                aborted.add(rid)
        for out in eng.step():
            if out.finished and out.request_id not in aborted:
                done.setdefault(out.request_id, {})[out.index] = out.token_ids
        step += 1
    assert preempted, "no preemption: the page pool is too large for this soak"
    assert aborted
    return {rid: [forks[k] for k in sorted(forks)] for rid, forks in done.items()}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_soak_leaves_nothing_held(method: str, tmp_path: Path) -> None:
    target = make_ckpt("lfm2", tmp_path / "lfm2")
    if method == "ngram":
        spec = SPEC
    else:
        draft = make_ckpt("lfm3", tmp_path / "lfm3")
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    eng = engine(target, spec, **KW)
    ours = soak(eng)
    ref = soak(engine(target, None, **KW))
    if method == "draft_model":
        # a sampled request's draft samples its proposals: the same law as speculation off,
        # not the same draw; its greedy requests stay token-identical
        sampled = {f"r{i}" for i in range(24) if mixed(i)[1].temperature > 0}
        ours = {rid: t for rid, t in ours.items() if rid not in sampled}
        ref = {rid: t for rid, t in ref.items() if rid not in sampled}
        assert ours
    assert ours == ref
    s = eng.stats()
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    if method == "draft_model":
        assert eng.scheduler.speculator.draft.num_held() == (0, 0)  # type: ignore[union-attr]
    assert_nothing_held(eng)
    assert eng.stats().prefix_cache_checkpoints == 0
