"""Draft-model speculation is lossless, and the draft's own state is exact.

Oracles: the same engine with speculation off (output), and the draft checkpoint run on its own
with speculation off (every proposal must be the draft's greedy continuation of the request's
tokens; a draft state that folded in a rejected proposal, or missed a token, proposes
something else). Drafts: another architecture than the target (partial acceptance), the
target itself (full acceptance) and the target cut to its first layers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from shortconv.engine.llm_engine import LLMEngine
from shortconv.errors import ConfigError
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.truncate import truncated_checkpoint
from tests.engine.test_spec_decode import (
    GREEDY,
    LONG,
    MORE_PROMPTS,
    PROMPTS,
    assert_accepts_and_rejects,
    assert_nothing_held,
    assert_same,
    cuts,
    engine,
    make_ckpt,
    run,
    run_forks,
    run_preempting,
    spec_counts,
)

K = 3


def draft_spec(draft: Path) -> dict[str, object]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("spec_draft")
    found = {arch: make_ckpt(arch, base / arch) for arch in ("lfm2", "zaya1", "lfm2_moe", "lfm3")}
    # its first 3 layers: conv, conv, attention
    found["lfm2_cut"] = truncated_checkpoint(found["lfm2"], 3, base / "lfm2_cut")
    return found


def draft_held(eng: LLMEngine) -> tuple[int, int]:
    draft = eng.scheduler.speculator.draft
    assert draft is not None
    return draft.num_held()


def assert_all_freed(eng: LLMEngine) -> None:
    assert draft_held(eng) == (0, 0)
    assert_nothing_held(eng)


def record_proposals(eng: LLMEngine) -> list[tuple[list[int], tuple[int, ...]]]:
    """(request's tokens, its proposals) of every verify row from here on."""
    draft, seen = eng.scheduler.speculator.draft, []
    assert draft is not None
    propose = draft.propose

    def recording(req, k):  # noqa: ANN001, ANN202 - Request, tuple of token ids
        got = propose(req, k)
        if got:
            seen.append((list(req.all_token_ids), got))
        return got

    draft.propose = recording  # type: ignore[method-assign]
    return seen


def assert_draft_greedy(draft: Path, seen: list[tuple[list[int], tuple[int, ...]]]) -> None:
    """Each proposal run is what the draft decodes greedily, alone, from the same tokens."""
    assert seen
    alone = engine(draft, None)
    for tokens, proposals in seen[:: max(1, len(seen) // 8)]:
        params = replace(GREEDY, max_tokens=len(proposals))
        want = run(alone, [tokens], params).outputs[0].token_ids
        assert tuple(want) == proposals, (tokens, proposals, want)


# LFM3 both ways: a sliding-window target frees window pages after acceptance only; a
# sliding-window draft keeps every page and rewrites its rejected positions.
PAIRS = [
    ("lfm2", "zaya1"),
    ("zaya1", "lfm2"),
    ("lfm2", "lfm2_moe"),
    ("lfm2", "lfm2_cut"),
    ("lfm3", "lfm2"),
    ("lfm2", "lfm3"),
]


@pytest.mark.parametrize(("target", "draft"), PAIRS)
def test_batch_of_mixed_requests_and_a_chunked_prompt(
    ckpts: dict[str, Path], target: str, draft: str
) -> None:
    off = replace(GREEDY, speculative=False)
    params, prompts = [GREEDY, off, GREEDY, GREEDY], [*PROMPTS, LONG]
    kw = {"max_num_batched_tokens": 16, "max_prefill_tokens_while_decoding": 8}
    ref = run(engine(ckpts[target], None, **kw), prompts, params)
    eng = engine(ckpts[target], draft_spec(ckpts[draft]), **kw)
    seen = record_proposals(eng)
    ours = run(eng, prompts, params)
    assert_same(ours, ref)
    assert_accepts_and_rejects(eng)  # rollback at partial acceptance is exercised
    assert max(ours.steps[1]) == 1  # the request that turned speculation off
    assert all(p.num_tokens <= 16 for p in ours.plans)
    assert_draft_greedy(ckpts[draft], seen)
    assert_all_freed(eng)


def test_the_target_as_its_own_draft_accepts_everything(ckpts: dict[str, Path]) -> None:
    """A draft equal to the target proposes the target's own greedy tokens: every proposal is
    accepted, so each committed draft state after a full run must be exact."""
    target = ckpts["lfm2"]
    ref = run(engine(target, None), [*PROMPTS, LONG], GREEDY)
    eng = engine(target, draft_spec(target))
    ours = run(eng, [*PROMPTS, LONG], GREEDY)
    assert_same(ours, ref)
    proposed, accepted = spec_counts(eng)
    assert proposed > 0 and accepted == proposed, (proposed, accepted)
    assert_all_freed(eng)


def test_one_request_with_a_truncated_target(ckpts: dict[str, Path]) -> None:
    ref = run(engine(ckpts["lfm2"], None), PROMPTS[:1], GREEDY)
    eng = engine(ckpts["lfm2"], draft_spec(ckpts["lfm2_cut"]))
    seen = record_proposals(eng)
    ours = run(eng, PROMPTS[:1], GREEDY)
    assert_same(ours, ref)
    assert_accepts_and_rejects(eng)
    assert max(ours.steps[0]) > 1
    assert_draft_greedy(ckpts["lfm2_cut"], seen)
    assert_all_freed(eng)


def test_stop_string_and_max_tokens_inside_an_accepted_run(ckpts: dict[str, Path]) -> None:
    params = replace(GREEDY, max_tokens=60)
    target, spec = ckpts["lfm2"], draft_spec(ckpts["lfm2_cut"])
    eng, ref_eng = engine(target, spec), engine(target, None)
    found: dict[str, tuple[SamplingParams, list[int], int]] = {}
    for prompt in [*PROMPTS, *MORE_PROMPTS]:
        for what, (p, i) in cuts(eng, prompt, params).items():
            found.setdefault(what, (p, prompt, i))
    assert {"max_tokens", "stop"} <= set(found), sorted(found)
    for what, (p, prompt, i) in found.items():
        ours, ref = run(eng, [prompt], p), run(ref_eng, [prompt], p)
        assert_same(ours, ref)
        assert len(ours.outputs[0].token_ids) == i + 1, what
    assert_all_freed(eng)


def test_preemption_and_resume(ckpts: dict[str, Path]) -> None:
    kw = {"num_kv_pages": 30, "enable_prefix_caching": False}
    target = ckpts["lfm2"]
    ref = run(engine(target, None, **kw), PROMPTS, GREEDY)
    eng = engine(target, draft_spec(ckpts["zaya1"]), **kw)
    assert_same(run_preempting(eng, PROMPTS, GREEDY), ref)
    assert_accepts_and_rejects(eng)
    assert_all_freed(eng)


def test_forks_each_draft_on_their_own_state(ckpts: dict[str, Path]) -> None:
    """Greedy n = 3 equals speculation off; seeded n = 3 (sampled proposals, rejection
    sampling: a different draw than speculation off, the same law) reproduces itself, with
    forks that differ."""
    greedy = replace(GREEDY, n=3, max_tokens=30)
    params = SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=30, ignore_eos=True)
    target = ckpts["lfm2"]
    eng = engine(target, draft_spec(ckpts["lfm2_cut"]))
    assert run_forks(eng, PROMPTS[0], greedy) == run_forks(engine(target, None), PROMPTS[0], greedy)
    sampled = run_forks(eng, PROMPTS[0], params)
    again = engine(target, draft_spec(ckpts["lfm2_cut"]))
    assert run_forks(again, PROMPTS[0], params) == sampled
    assert len(set(map(tuple, sampled))) > 1
    assert_accepts_and_rejects(eng)
    assert_all_freed(eng)


def test_prefix_cache_hit(ckpts: dict[str, Path]) -> None:
    target = ckpts["zaya1"]
    eng, ref_eng = engine(target, draft_spec(ckpts["lfm2"])), engine(target, None)
    first = run(eng, PROMPTS[:1], GREEDY).outputs[0]
    follow = [*PROMPTS[0], *first.token_ids, 5, 9]
    ours, ref = run(eng, [follow], GREEDY), run(ref_eng, [follow], GREEDY)
    assert_same(ours, ref)
    assert ours.outputs[0].num_cached_tokens > len(PROMPTS[0])
    assert_accepts_and_rejects(eng)
    assert_all_freed(eng)


def test_a_draft_with_another_vocabulary_is_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    other = make_tiny_checkpoint("lfm2", tmp_path / "v32", {"vocab_size": 32}, with_tokenizer=False)
    with pytest.raises(
        ConfigError, match=r"target lfm2 and draft v32 differ in vocab_size \(16 vs 32\)"
    ):
        engine(ckpts["lfm2"], draft_spec(other))


def test_a_draft_with_another_tokenizer_is_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from shortconv.engine import tokenizer as toks

    other = truncated_checkpoint(ckpts["lfm2"], 2, tmp_path / "tok")
    toks.build_byte_tokenizer(264, named_special=("<|tool|>",)).save_pretrained(str(other))
    with pytest.raises(ConfigError, match="target lfm2 and draft tok have different tokenizers"):
        engine(ckpts["lfm2"], draft_spec(other))
