"""Speculative decoding (n-gram) is lossless: the same engine with speculation off is the oracle.

The checkpoints have a 16-token vocabulary, so greedy output repeats itself and n-gram
proposals (`prompt_lookup_min=1`) are both accepted and rejected; every test asserts both
happened, or it would prove nothing. A byte tokenizer is saved beside the weights (ids 4..15
decode to single characters) so stop strings run through the engine's detokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.engine import tokenizer as toks
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import FinishReason
from shortconv.engine.plan import StepPlan
from shortconv.llm import LLM, build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [6, 7, 8, 10, 6, 7, 8, 10, 6], [7, 8, 7, 8, 7, 8, 7]]
LONG = [4 + (i * 7) % 12 for i in range(70)]  # chunked at max_num_batched_tokens=16
MORE_PROMPTS = [[4 + (i * m) % 12 for i in range(9)] for m in (1, 5, 7, 11)] + [[15, 14] * 4]


def make_ckpt(arch: str, out: Path) -> Path:
    path = make_tiny_checkpoint(arch, out, {"vocab_size": 16}, seed=11, with_tokenizer=False)
    toks.build_byte_tokenizer(260).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["lfm2", "zaya1", "lfm3", "lfm2_moe"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(request.param, tmp_path_factory.mktemp(request.param))


def engine(ckpt: Path, spec: dict[str, object] | None, **kw: object) -> LLMEngine:
    kw.setdefault("kv_page_size", 4)  # pages are trimmed after rejections: many boundaries
    cfg = EngineConfig(speculative_config=spec, **kw)  # type: ignore[arg-type]
    return build_engine(ckpt, dtype="float32", engine_config=cfg)


@dataclass
class Run:
    outputs: list[object]  # RequestOutput per prompt, in order
    steps: list[list[int]]  # per prompt: how many tokens each of its steps added
    plans: list[StepPlan]


def run(
    eng: LLMEngine, prompts: Sequence[list[int]], params: Sequence[SamplingParams] | SamplingParams
) -> Run:
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    plans: list[StepPlan] = []
    execute = eng.executor.execute

    def recording(plan: StepPlan):  # noqa: ANN202 - the executor's StepResult
        plans.append(plan)
        return execute(plan)

    eng.executor.execute = recording  # type: ignore[method-assign]
    try:
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        outs, steps = {}, {rid: [] for rid in ids}
        while eng.has_unfinished():
            for out in eng.step():
                steps[out.request_id].append(len(out.new_token_ids))
                if out.finished:
                    outs[out.request_id] = out
    finally:
        eng.executor.execute = execute  # type: ignore[method-assign]
    return Run([outs[r] for r in ids], [steps[r] for r in ids], plans)


def spec_counts(eng: LLMEngine) -> tuple[int, int]:
    s = eng.stats()
    return s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens


def assert_same(ours: Run, ref: Run) -> None:
    for a, b in zip(ours.outputs, ref.outputs, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


def assert_accepts_and_rejects(eng: LLMEngine, before: tuple[int, int] = (0, 0)) -> None:
    proposed, accepted = (n - b for n, b in zip(spec_counts(eng), before, strict=True))
    assert 0 < accepted < proposed, (proposed, accepted)


def assert_nothing_held(eng: LLMEngine) -> None:
    eng.flush_prefix_cache()
    stats = eng.stats()
    assert (stats.slots_used, stats.kv_pages_used) == (0, 0)
    assert stats.kv_pages_used_by_kind["sliding"] == 0


def test_one_request(ckpt: Path) -> None:
    ref = run(engine(ckpt, None), PROMPTS[:1], GREEDY)
    eng = engine(ckpt, SPEC)
    ours = run(eng, PROMPTS[:1], GREEDY)
    assert_same(ours, ref)
    assert_accepts_and_rejects(eng)
    assert max(ours.steps[0]) > 1  # some step yielded an accepted run
    assert_nothing_held(eng)


def test_batch_mixed_with_non_speculating_requests_and_a_chunked_prompt(ckpt: Path) -> None:
    off = replace(GREEDY, speculative=False)
    params = [GREEDY, off, GREEDY, GREEDY]
    prompts = [*PROMPTS, LONG]
    kw = {"max_num_batched_tokens": 16, "max_prefill_tokens_while_decoding": 8}
    ref = run(engine(ckpt, None, **kw), prompts, params)
    eng = engine(ckpt, SPEC, **kw)
    ours = run(eng, prompts, params)
    assert_same(ours, ref)
    assert_accepts_and_rejects(eng)
    assert max(ours.steps[1]) == 1  # the request that turned speculation off
    mixed = [
        p
        for p in ours.plans
        if any(s.num_draft for s in p.seqs)
        and any(s.sampling is None for s in p.seqs)  # a prompt chunk that does not end it
        and any(s.num_tokens == 1 and s.start_pos > 0 for s in p.seqs)  # a plain decode row
    ]
    assert mixed, "no step mixed verify rows, a prefill chunk and a plain decode row"
    assert all(p.num_tokens <= 16 for p in ours.plans)
    assert_nothing_held(eng)


def cut_points(steps: list[int]) -> list[int]:
    """Output indices inside a step's run: more tokens of the same step came after them."""
    points, i = [], 0
    for n in steps:
        points += range(i, i + n - 1)
        i += n
    return points


def first_stop_string(eng: LLMEngine, tokens: list[int], i: int) -> str | None:
    """The shortest string the text first contains once token i is out (None: token i adds
    no text, a special token)."""
    hf = eng.tokenizer.hf  # type: ignore[union-attr]
    before = hf.decode(tokens[:i], skip_special_tokens=True)
    text = hf.decode(tokens[: i + 1], skip_special_tokens=True)
    if len(text) == len(before):
        return None
    return next((text[-w:] for w in range(1, 5) if text[-w:] not in before), None)


def cuts(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> dict[str, tuple]:
    """Per kind of stop, (its params, the output index it ends at) where that index is inside
    an accepted run of the free-running speculative output of `prompt`."""
    free = run(eng, [prompt], params)
    tokens, points = free.outputs[0].token_ids, cut_points(free.steps[0])
    found: dict[str, tuple] = {}
    if points:
        found["max_tokens"] = (replace(params, max_tokens=points[0] + 1), points[0])
    firsts = [i for i in points if tokens[i] not in tokens[:i]]
    if firsts:
        found["stop_token_ids"] = (replace(params, stop_token_ids=(tokens[firsts[0]],)), firsts[0])
    stops = [(i, s) for i in points if (s := first_stop_string(eng, tokens, i)) is not None]
    if stops:
        found["stop"] = (replace(params, stop=(stops[0][1],)), stops[0][0])
    return found


def test_stop_token_stop_string_and_max_tokens_inside_an_accepted_run(ckpt: Path) -> None:
    """The same run, cut inside one of its accepted runs (the runs before the cut are the same
    verify steps): the output ends exactly where one token a step ends."""
    params = replace(GREEDY, max_tokens=60)
    eng, ref_eng = engine(ckpt, SPEC), engine(ckpt, None)
    found: dict[str, tuple[SamplingParams, list[int], int]] = {}
    # NOTE: a token seen first inside a run is rare in a 16-token vocabulary: look further.
    for prompt in [*PROMPTS, *MORE_PROMPTS]:
        for what, (p, i) in cuts(eng, prompt, params).items():
            found.setdefault(what, (p, prompt, i))
        if len(found) == 3:
            break
    # NOTE: ZAYA1's tiny output settles into repeats where no token is new inside a run; a stop
    # id ends a run on the scheduler's same path as max_tokens (`Scheduler._append`).
    assert {"max_tokens", "stop"} <= set(found), sorted(found)
    for what, (p, prompt, i) in found.items():
        ours, ref = run(eng, [prompt], p), run(ref_eng, [prompt], p)
        assert_same(ours, ref)
        out = ours.outputs[0]
        assert len(out.token_ids) == i + 1, what  # ends exactly at the cut
        want = FinishReason.LENGTH if what == "max_tokens" else FinishReason.STOP
        assert out.finish_reason is want, what
    assert_nothing_held(eng)


def test_seeded_sampling_draws_what_one_token_a_step_draws(ckpt: Path) -> None:
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=40, ignore_eos=True)
    ref = run(engine(ckpt, None), PROMPTS, params)
    eng = engine(ckpt, SPEC)
    assert_same(run(eng, PROMPTS, params), ref)
    assert_accepts_and_rejects(eng)


def test_prefix_cache_hit_after_speculation(ckpt: Path) -> None:
    """The end-of-generation checkpoint of a speculating request is resumed by a longer prompt."""
    eng, ref_eng = engine(ckpt, SPEC), engine(ckpt, None)
    first = run(eng, PROMPTS[:1], GREEDY).outputs[0]
    follow = [*PROMPTS[0], *first.token_ids, 5, 9]
    ours, ref = run(eng, [follow], GREEDY), run(ref_eng, [follow], GREEDY)
    assert_same(ours, ref)
    assert ours.outputs[0].num_cached_tokens > len(PROMPTS[0])
    assert_nothing_held(eng)


GRAPHS = {"enable_graphs": True, "graph_batch_sizes": (1, 2, 4), "graph_context_sizes": (32, 64)}


def other_arch_draft(ckpt: Path, out: Path) -> dict[str, object]:
    """A draft_model config whose draft is of another architecture than `ckpt`'s: ZAYA1 (CCA)
    for every target but ZAYA1, LFM2 for it."""
    other = "lfm2" if ModelConfig.from_dir(ckpt).arch == "zaya1" else "zaya1"
    draft = make_ckpt(other, out / f"draft-{other}")
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_graph_captured_verify_equals_speculation_off(
    ckpt: Path, method: str, tmp_path: Path
) -> None:
    """Graphs on: full-width verify steps replay the verify ladder's buckets (counted), and
    output is what speculation off gives (one request, then a batch that mixes widths)."""
    ref = run(engine(ckpt, None, **GRAPHS), PROMPTS[:1] + PROMPTS, GREEDY)
    eng = engine(ckpt, SPEC if method == "ngram" else other_arch_draft(ckpt, tmp_path), **GRAPHS)
    ours = run(eng, PROMPTS[:1], GREEDY)
    ours.outputs += run(eng, PROMPTS, GREEDY).outputs
    assert_same(ours, ref)
    assert_accepts_and_rejects(eng)
    graphs = eng.graph_stats()
    assert graphs is not None
    assert graphs.verify_replays > 0, graphs
    assert graphs.replay_failures == {"prepare": 0, "replay": 0}, graphs
    assert_nothing_held(eng)


def test_llm_facade_takes_graphs_and_speculation(tmp_path: Path) -> None:
    ckpt = make_ckpt("lfm2", tmp_path)
    ref = LLM(ckpt, dtype="float32").generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    llm = LLM(ckpt, dtype="float32", speculative_config=SPEC, enable_graphs=True)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert_accepts_and_rejects(llm.engine)


def test_preemption_and_resume_while_speculating(tmp_path: Path) -> None:
    """Pages run out mid-run: a speculating request is preempted (spec slots and pages freed)
    and recomputed later; output is still what speculation off gives."""
    ckpt = make_ckpt("lfm2", tmp_path)
    kw = {"num_kv_pages": 30, "enable_prefix_caching": False}
    ref = run(engine(ckpt, None, **kw), PROMPTS, GREEDY)
    eng = engine(ckpt, SPEC, **kw)
    assert_same(run_preempting(eng, PROMPTS, GREEDY), ref)
    assert_accepts_and_rejects(eng)
    assert_nothing_held(eng)


def run_preempting(eng: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams) -> Run:
    """`run`, asserting that some request was preempted on the way."""
    preempt, preempted = eng.scheduler._preempt, []

    def counting(req):  # noqa: ANN001, ANN202 - the scheduler's Request
        preempted.append(req.request_id)
        return preempt(req)

    eng.scheduler._preempt = counting  # type: ignore[method-assign]
    ours = run(eng, prompts, params)
    assert preempted, "no preemption: the page pool is too large for this test"
    return ours


def test_forks_speculate_each_on_their_own_state(tmp_path: Path) -> None:
    """n = 3, seeded: each fork copies its parent's state, then speculates on its own slots."""
    ckpt = make_ckpt("lfm2", tmp_path)
    params = SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=30, ignore_eos=True)
    ref, eng = engine(ckpt, None), engine(ckpt, SPEC)
    want = run_forks(ref, PROMPTS[0], params)
    assert run_forks(eng, PROMPTS[0], params) == want
    assert len(set(map(tuple, want))) > 1  # the forks really differ
    assert_accepts_and_rejects(eng)
    assert_nothing_held(eng)


def run_forks(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Every fork's tokens, by index."""
    eng.add_request(prompt, params)
    done: dict[int, list[int]] = {}
    while eng.has_unfinished():
        done.update({o.index: o.token_ids for o in eng.step() if o.finished})
    return [done[i] for i in sorted(done)]
