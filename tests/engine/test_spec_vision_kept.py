"""Speculation on LFM2-VL where state is kept or dropped: an image in a session's second turn
(the turn resumes the first turn's kept state, then speculates after a new image), and
preemption and resume of image requests while they speculate. n-gram and a text draft model
(the VL model's language side, `test_spec_vision.language_side`); the oracle is the same
engine with speculation off: token-identical greedy output."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from vision_inputs import Image, engine_images, follow_up, pixels, prompt

from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.vision import build_tokenizer, make_tiny_lfm2_vl
from tests.engine.test_spec_decode import assert_nothing_held
from tests.engine.test_spec_vision import NGRAM, language_side, spec_counts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
FIRST = Image(((6, 8),))  # 12 placeholders
SECOND = Image.tiled(1, 2, (4, 8))  # two 4-token tiles and an 8-token thumbnail


@dataclass
class Vl:
    path: Path
    draft: Path


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Vl:
    base = tmp_path_factory.mktemp("lfm2_vl_kept")
    path = make_tiny_lfm2_vl(base / "vl", seed=3)
    return Vl(path, language_side(path, base / "draft"))


def spec_for(vl: Vl, method: str | None) -> dict[str, object] | None:
    if method == "draft_model":
        return {"method": "draft_model", "model": str(vl.draft), "num_speculative_tokens": 3}
    return NGRAM if method == "ngram" else None


def build(vl: Vl, method: str | None, **kw: object) -> LLMEngine:
    cfg = EngineConfig(speculative_config=spec_for(vl, method), kv_page_size=8, **kw)  # type: ignore[arg-type]
    return build_engine(vl.path, dtype="float32", engine_config=cfg)


def finish(eng: LLMEngine, rids: list[str]) -> list[tuple[list[int], int]]:
    """Each request's (tokens, prompt tokens resumed from kept state), run to the end."""
    done: dict[str, tuple[list[int], int]] = {}
    while eng.has_unfinished():
        done |= {o.request_id: (o.token_ids, o.num_cached_tokens) for o in eng.step() if o.finished}
    assert eng.executor.runner.images.entries == {}, "the encoder cache must end empty"
    return [done[r] for r in rids]


def two_turns(vl: Vl, method: str | None) -> tuple[list[list[int]], int, LLMEngine]:
    """A session: an image and a question, then a second turn with a new image. Returns both
    answers, the second turn's resumed prompt tokens, and the engine."""
    tok = build_tokenizer(1024)
    eng = build(vl, method)
    ids, images = prompt(tok, [("user", [FIRST, "What is this?"])])
    rid = eng.add_request(
        ids, GREEDY, session_id="s", images=engine_images(images, pixels(images, seed=1))
    )
    ((first, _),) = finish(eng, [rid])
    ids2, more = follow_up(tok, ids, first, [SECOND, "And this one?"])
    images2 = images + more  # the first image's pixels are drawn first: the same
    rid = eng.add_request(
        ids2, GREEDY, session_id="s", images=engine_images(images2, pixels(images2, seed=1))
    )
    ((second, cached),) = finish(eng, [rid])
    return [first, second], cached, eng


Turns = Callable[[str | None], tuple[list[list[int]], int, LLMEngine]]
Preempted = Callable[[str | None], tuple[list[list[int]], list[str], LLMEngine]]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_an_image_in_a_sessions_second_turn(vl: Vl, method: str) -> None:
    check_second_turn(functools.partial(two_turns, vl), method)


def check_second_turn(two_turns: Turns, method: str) -> None:
    """Speculation on == off for both turns; the second resumes the first's kept state."""
    ref, ref_cached, _ = two_turns(None)
    ours, cached, eng = two_turns(method)
    assert ours == ref
    assert cached == ref_cached > 0, "the second turn resumes the first turn's kept state"
    proposed, accepted = spec_counts(eng)
    assert accepted < proposed, (proposed, accepted)  # some proposal was rolled back
    if method == "draft_model":
        assert accepted > 0, (proposed, accepted)


def count_preemptions(eng: LLMEngine) -> list[str]:
    """The ids of the requests `eng`'s scheduler preempts, as it preempts them."""
    preempt, preempted = eng.scheduler._preempt, []

    def counting(req):  # noqa: ANN001, ANN202 - the scheduler's own signature
        preempted.append(req.request_id)
        return preempt(req)

    eng.scheduler._preempt = counting  # type: ignore[method-assign]
    return preempted


def preempted_run(vl: Vl, method: str | None) -> tuple[list[list[int]], list[str], LLMEngine]:
    """Three image requests and a text one on a page pool too small for all of them."""
    tok = build_tokenizer(1024)
    eng = build(vl, method, num_kv_pages=14, enable_prefix_caching=False)
    preempted = count_preemptions(eng)
    rids = []
    for seed, parts in enumerate(
        [[FIRST, "What?"], [SECOND, "Describe."], [FIRST, "Why?"], ["Text."]]
    ):
        ids, images = prompt(tok, [("user", parts)])
        imgs = engine_images(images, pixels(images, seed)) if images else []
        rids.append(eng.add_request(ids, GREEDY, images=imgs))
    return [tokens for tokens, _ in finish(eng, rids)], preempted, eng


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_image_requests_preempted_while_speculating(vl: Vl, method: str) -> None:
    check_preempted(functools.partial(preempted_run, vl), method)


def check_preempted(preempted_run: Preempted, method: str) -> None:
    """Speculation on == off with preemption; every slot and page free after."""
    ref, _, _ = preempted_run(None)
    ours, preempted, eng = preempted_run(method)
    assert preempted, "no preemption: the page pool is too large for this test"
    assert ours == ref
    proposed, accepted = spec_counts(eng)
    assert accepted < proposed, (proposed, accepted)
    assert_nothing_held(eng)
    if method == "draft_model":
        assert eng.scheduler.speculator.draft.num_held() == (0, 0)  # type: ignore[union-attr]
