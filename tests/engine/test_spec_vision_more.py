"""More speculation on the vision models (LFM2-VL, LFM3-VL), n-gram and the language-side draft
(`test_spec_vision.language_side`), each against the same engine config with speculation off,
token for token: n = 3 forks of an image request, a json_schema answer and a forced tool call
on an image request, a stop string and `max_tokens` that end inside an accepted run, a
prefix-cache hit on an image request, an image request's prompt in several chunks, and graphs
on. Every test asserts that proposals were accepted and rejected (a rollback ran and kept a
proposal) and that nothing is held after."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import jsonschema
import pytest
from lfm3_vl_inputs import Lfm3VlCase, Pic
from vision_inputs import Image, engine_images, pixels, prompt

from shortconv.configs.hf.processors import load_processor
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import FinishReason, RequestOutput
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import InvalidRequest, SamplingParams
from shortconv.tiny.vision import build_tokenizer
from tests.engine.test_spec_decode import GRAPHS, assert_nothing_held, cut_points, first_stop_string
from tests.engine.test_spec_grammar import CASES, SHOWN
from tests.engine.test_spec_vision import VlModel, make_vl, spec_config, spec_counts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
METHODS = ["ngram", "draft_model"]
Ask = Callable[[str], tuple[list[int], list]]  # a user turn with one image, then `text`


@dataclass
class Vl:
    model: VlModel
    ask: Ask


def lfm2_vl_ask() -> Ask:
    tok = build_tokenizer(1024)

    def ask(text: str) -> tuple[list[int], list]:
        ids, images = prompt(tok, [("user", [Image(((6, 8),)), text])])
        return ids, engine_images(images, pixels(images, 1))

    return ask


def lfm3_vl_ask(model: VlModel) -> Ask:
    case = Lfm3VlCase(model.path, None, load_processor(model.path), GREEDY.max_tokens)  # type: ignore[arg-type]

    def ask(text: str) -> tuple[list[int], list]:
        req = case.request([("user", [Pic(20, 44), text])])
        return req.ids, req.images

    return ask


@pytest.fixture(scope="module", params=["lfm2_vl", "lfm3_vl"])
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Vl:
    model = make_vl(request.param, tmp_path_factory.mktemp(request.param))
    return Vl(model, lfm2_vl_ask() if request.param == "lfm2_vl" else lfm3_vl_ask(model))


def engine(vl: Vl, method: str | None, **kw: object) -> LLMEngine:
    cfg = replace(spec_config(vl.model, method), **kw)
    return build_engine(vl.model.path, dtype="float32", engine_config=cfg)


Req = tuple[list[int], list, SamplingParams]


@dataclass
class Run:
    outputs: list[RequestOutput]  # per request and fork, in order
    steps: list[list[int]]  # per output: how many tokens each of its steps added


def run(eng: LLMEngine, reqs: Sequence[Req]) -> Run:
    """Run `reqs` together to the end."""
    rids = [eng.add_request(ids, p, images=images) for ids, images, p in reqs]
    outs: dict[tuple[str, int], RequestOutput] = {}
    steps: dict[tuple[str, int], list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            steps.setdefault((o.request_id, o.index), []).append(len(o.new_token_ids))
            if o.finished:
                outs[o.request_id, o.index] = o
    assert eng.executor.runner.images.entries == {}, "the encoder cache must end empty"
    keys = [k for r in rids for k in sorted(k for k in outs if k[0] == r)]
    return Run([outs[k] for k in keys], [steps[k] for k in keys])


def assert_same(ours: Run, ref: Run) -> None:
    assert len(ours.outputs) == len(ref.outputs)
    for a, b in zip(ours.outputs, ref.outputs, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


def assert_spec_bites(eng: LLMEngine) -> None:
    """Proposals were rejected (a rollback ran), and with the draft also accepted (a rollback
    kept some); every slot, page and draft slot is free after."""
    proposed, accepted = spec_counts(eng)
    assert accepted < proposed, (proposed, accepted)
    assert_nothing_held(eng)
    assert eng.grammars.num_active == 0
    draft = eng.scheduler.speculator.draft  # type: ignore[union-attr]
    if draft is not None:
        assert accepted > 0, (proposed, accepted)
        assert draft.num_held() == (0, 0)


def lossless(vl: Vl, method: str, reqs: Sequence[Req], **kw: object) -> tuple[Run, LLMEngine]:
    """`reqs` with speculation on equal the same engine config with it off."""
    ref = run(engine(vl, None, **kw), reqs)
    eng = engine(vl, method, **kw)
    ours = run(eng, reqs)
    assert_same(ours, ref)
    return ours, eng


@pytest.mark.parametrize("method", METHODS)
def test_n3_forks_beside_an_image_request(vl: Vl, method: str) -> None:
    """n = 3 forks of the text request, each speculating on its own slots after copying its
    parent's state, in a batch with a speculating image request. Seeded forks with n-gram;
    greedy ones with the draft (a sampled draft draws another sample of the same law, not the
    tokens speculation off draws). n > 1 on an image request itself is refused by the engine
    (forks do not copy images), speculation or not: a clear error, nothing held."""
    forks = replace(GREEDY, n=3)
    if method == "ngram":
        forks = SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=16, ignore_eos=True)
    ids, images = vl.ask("What is this?")
    text_ids, _ = vl.model.requests[1]
    ours, eng = lossless(vl, method, [(ids, images, GREEDY), (text_ids, [], forks)])
    assert len(ours.outputs) == 4
    if method == "ngram":
        assert len({tuple(o.token_ids) for o in ours.outputs[1:]}) > 1  # the forks differ
    with pytest.raises(InvalidRequest, match="n > 1 with images"):
        eng.add_request(ids, forks, images=images)
    assert_spec_bites(eng)


@pytest.mark.parametrize("case", ["json_schema", "named_tool"])
@pytest.mark.parametrize("method", METHODS)
def test_structured_answer_on_an_image_request(vl: Vl, method: str, case: str) -> None:
    """A json_schema answer or a forced tool call about an image: valid, and equal to off.
    n-gram proposes the grammar's own text from a prompt that shows it; the draft, asked
    plainly, has some proposals accepted and some cut (shown the document, it gets all
    accepted on LFM3-VL, and a rollback that keeps everything proves nothing)."""
    grammar, schema = CASES[case]
    ids, images = vl.ask(f"Answer like {SHOWN} {SHOWN}: " if method == "ngram" else "What is this?")
    params = SamplingParams(temperature=0.0, max_tokens=120, grammar=grammar)
    ours, eng = lossless(vl, method, [(ids, images, params)])
    out = ours.outputs[0]
    assert out.finish_reason is FinishReason.STOP, out.text
    jsonschema.validate(json.loads(out.text), schema)
    assert_spec_bites(eng)


def cuts(tokens: list[int], steps: list[int], eng: LLMEngine) -> dict[str, tuple]:
    """(params, the output index it ends at) for a stop string and for max_tokens, where that
    index is inside an accepted run of the free-running speculative output."""
    points = cut_points(steps)
    found: dict[str, tuple] = {}
    if points:
        found["max_tokens"] = (replace(GREEDY, max_tokens=points[0] + 1), points[0])
    stops = [(i, s) for i in points if (s := first_stop_string(eng, tokens, i)) is not None]
    if stops:
        found["stop"] = (replace(GREEDY, max_tokens=24, stop=(stops[0][1],)), stops[0][0])
    return found


# NOTE: draft only: a random 512-token model rarely repeats itself, so n-gram proposals on
# these models are all rejected and there is no accepted run to cut inside.
@pytest.mark.parametrize("method", ["draft_model"])
def test_stop_string_and_max_tokens_inside_an_accepted_run(vl: Vl, method: str) -> None:
    """Cut inside an accepted run of the image request (or, where it accepted no run, of the
    text request beside it): the output ends exactly there, as with speculation off."""
    ids, images = vl.ask("What is this?")
    text_ids, _, _ = (*vl.model.requests[1], None)
    free = replace(GREEDY, max_tokens=24)
    eng, ref_eng = engine(vl, method), engine(vl, None)
    got = run(eng, [(ids, images, free), (text_ids, [], free)])
    found = cuts(got.outputs[0].token_ids, got.steps[0], eng)
    which = 0 if {"max_tokens", "stop"} <= set(found) else 1
    if which:
        found = cuts(got.outputs[1].token_ids, got.steps[1], eng)
    assert {"max_tokens", "stop"} <= set(found), sorted(found)
    before = spec_counts(eng)
    for what, (p, i) in found.items():
        reqs = [(ids, images, p if which == 0 else free), (text_ids, [], p if which else free)]
        ours, ref = run(eng, reqs), run(ref_eng, reqs)
        assert_same(ours, ref)
        out = ours.outputs[which]
        assert len(out.token_ids) == i + 1, what  # ends exactly at the cut
        assert out.finish_reason is (
            FinishReason.LENGTH if what == "max_tokens" else FinishReason.STOP
        )
    assert spec_counts(eng) != before
    assert_spec_bites(eng)


@pytest.mark.parametrize("method", METHODS)
def test_prefix_cache_hit_on_an_image_request(vl: Vl, method: str) -> None:
    """An image request, then the same request grown by its answer and a few tokens: the second
    resumes the first's end-of-generation checkpoint (image included), then speculates."""
    ids, images = vl.ask("What is this?")
    ref_eng, eng = engine(vl, None), engine(vl, method)
    first = run(eng, [(ids, images, GREEDY)])
    assert_same(first, run(ref_eng, [(ids, images, GREEDY)]))
    follow = [(ids + first.outputs[0].token_ids + ids[-3:], images, GREEDY)]
    ours, ref = run(eng, follow), run(ref_eng, follow)
    assert_same(ours, ref)
    assert first.outputs[0].num_cached_tokens == 0
    assert ours.outputs[0].num_cached_tokens > len(ids)
    assert_spec_bites(eng)


@pytest.mark.parametrize("method", METHODS)
def test_an_image_prompt_in_chunks(vl: Vl, method: str) -> None:
    """A step budget of 8 tokens: the image request's prompt spans several chunks, while the
    text request beside it already speculates."""
    ids, images = vl.ask("What is this?")
    text_ids, _ = vl.model.requests[1]
    reqs = [(ids, images, GREEDY), (text_ids, [], GREEDY)]
    kw = {"max_num_batched_tokens": 8, "max_prefill_tokens_while_decoding": 4}
    assert len(ids) > 2 * 8
    _, eng = lossless(vl, method, reqs, **kw)
    assert_spec_bites(eng)


@pytest.mark.parametrize("method", METHODS)
def test_graphs_on(vl: Vl, method: str) -> None:
    """Graphs on: the image request alone replays the verify ladder's buckets."""
    ids, images = vl.ask("What is this?")
    _, eng = lossless(vl, method, [(ids, images, GREEDY)], **GRAPHS)
    graphs = eng.graph_stats()
    assert graphs is not None
    assert graphs.verify_replays > 0, graphs
    assert graphs.replay_failures == {"prepare": 0, "replay": 0}, graphs
    assert_spec_bites(eng)


@pytest.mark.parametrize("method", METHODS)
def test_the_triton_path(vl: Vl, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`SHORTCONV_KERNELS=triton` under `TRITON_INTERPRET=1`: the verify rows of the image and
    the text request run the Triton extend kernels (the encoder its SDPA-free torch attention:
    it has no Triton kernel), equal to the same path with speculation off."""
    pytest.importorskip("triton")
    from triton_path import force_triton_path

    calls = force_triton_path(monkeypatch)
    ids, images = vl.ask("What is this?")
    text_ids, _ = vl.model.requests[1]
    _, eng = lossless(vl, method, [(ids, images, GREEDY), (text_ids, [], GREEDY)])
    assert calls["paged_attention_extend_triton"] > 0, calls
    assert_spec_bites(eng)
