"""Speculation on LFM3-VL where state is kept or dropped (test_spec_vision_kept.py does LFM2-VL):
a session whose second turn adds a new image and resumes the first turn's kept state, and image
requests preempted and resumed while they speculate. n-gram and a text draft (the VL model's
language side); the oracle is the same engine with speculation off, token for token."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
from lfm3_vl_inputs import Lfm3VlCase, Pic

from shortconv.configs.config import EngineConfig
from shortconv.configs.hf.processors import load_processor
from shortconv.engine.llm_engine import LLMEngine
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.lfm3_vl import make_tiny_lfm3_vl
from tests.engine.test_spec_vision import NGRAM, language_side
from tests.engine.test_spec_vision_kept import (
    check_preempted,
    check_second_turn,
    count_preemptions,
    finish,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@dataclass
class Vl:
    case: Lfm3VlCase
    draft: Path


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Vl:
    base = tmp_path_factory.mktemp("lfm3_vl_kept")
    path = make_tiny_lfm3_vl(base / "vl", seed=3)
    case = Lfm3VlCase(path, None, load_processor(path), GREEDY.max_tokens)  # type: ignore[arg-type]
    return Vl(case, language_side(path, base / "draft"))


def build(vl: Vl, method: str | None, **kw: object) -> LLMEngine:
    spec = None
    if method == "draft_model":
        spec = {"method": "draft_model", "model": str(vl.draft), "num_speculative_tokens": 3}
    elif method == "ngram":
        spec = NGRAM
    cfg = EngineConfig(speculative_config=spec, kv_page_size=8, **kw)  # type: ignore[arg-type]
    return build_engine(vl.case.path, dtype="float32", engine_config=cfg)


def two_turns(vl: Vl, method: str | None) -> tuple[list[list[int]], int, LLMEngine]:
    eng = build(vl, method)
    first_req = vl.case.request([("user", [Pic(20, 44), "What is this?"])])
    rid = eng.add_request(first_req.ids, GREEDY, session_id="s", images=first_req.images)
    ((first, _),) = finish(eng, [rid])
    second_req = vl.case.follow_up(first_req, first, [Pic(36, 28), "And this one?"])
    rid = eng.add_request(second_req.ids, GREEDY, session_id="s", images=second_req.images)
    ((second, cached),) = finish(eng, [rid])
    return [first, second], cached, eng


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_an_image_in_a_sessions_second_turn(vl: Vl, method: str) -> None:
    check_second_turn(functools.partial(two_turns, vl), method)


def preempted_run(vl: Vl, method: str | None) -> tuple[list[list[int]], list[str], LLMEngine]:
    """Three image requests and a text one on a page pool too small for all of them."""
    eng = build(vl, method, num_kv_pages=14, enable_prefix_caching=False)
    preempted = count_preemptions(eng)
    turns = [[Pic(20, 44), "What?"], [Pic(36, 28), "Describe."], [Pic(20, 44), "Why?"], ["Hi."]]
    rids = []
    for parts in turns:
        req = vl.case.request([("user", parts)])
        rids.append(eng.add_request(req.ids, GREEDY, images=req.images))
    return [tokens for tokens, _ in finish(eng, rids)], preempted, eng


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_image_requests_preempted_while_speculating(vl: Vl, method: str) -> None:
    check_preempted(functools.partial(preempted_run, vl), method)
