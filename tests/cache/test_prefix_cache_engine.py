"""Automatic prefix caching end to end in the engine: a cache hit decodes what the same request
decodes with caching off, for LFM2, LFM2-MoE and ZAYA1, and every resource comes back.

Pages are 8 tokens and checkpoints every 16 prompt tokens, with a small token budget so long
prompts are prefilled in chunks (checkpoints land inside chunks as well as at their ends). The
expected `num_cached_tokens` follows from the rules alone: the deepest checkpoint (a multiple of
16, an earlier end of prompt, or an earlier end of generation) that prefixes the prompt and
stops short of its last token.
"""

from __future__ import annotations

import random

import pytest
from oracle import NEAR_TIE

from shortconv.configs.config import EngineConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import RequestOutput
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

G = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
PAGE, EVERY = 8, 16
SYSTEM = [(37 * i + 11) % 240 + 3 for i in range(40)]  # a 40-token "system prompt"


def config(caching: bool, **kw: object) -> EngineConfig:
    base = dict(
        max_num_seqs=4,
        max_num_batched_tokens=24,
        kv_page_size=PAGE,
        prefix_checkpoint_interval=EVERY,
        enable_prefix_caching=caching,
    )
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe", "lfm3", "zaya1"])
def ckpt(request, tmp_path_factory):
    if request.param == "zaya1" and (reason := transformers_lacks("zaya")):
        pytest.skip(reason)
    return make_tiny_checkpoint(
        request.param, tmp_path_factory.mktemp(request.param), seed=5, with_tokenizer=False
    )


@pytest.fixture(scope="module")
def ref(ckpt) -> LLMEngine:
    return build_engine(ckpt, dtype="float32", engine_config=config(False))


def drive(eng: LLMEngine, prompts: list[list[int]]) -> list[RequestOutput]:
    """Add every prompt at once and step until all have finished."""
    ids = [eng.add_request(p, G) for p in prompts]
    done: dict[str, RequestOutput] = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def solo(ref: LLMEngine, prompt: list[int]) -> RequestOutput:
    return drive(ref, [prompt])[0]


def assert_same(got: RequestOutput, want: RequestOutput) -> None:
    """Greedy tokens equal, except past a near-tie of the uncached run (a resumed prefill sums
    in another order, so logits may differ in the last bits)."""
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)):
        if a != b:
            top = want.top_logprobs[i]
            assert top[0][1] - top[1][1] < NEAR_TIE, f"token {i}: cached {a} != uncached {b}"
            return
        assert got.logprobs[i] == pytest.approx(want.logprobs[i], abs=1e-4)


def check(eng: LLMEngine, ref: LLMEngine, prompts: list[list[int]], cached: list[int]) -> None:
    outs = drive(eng, prompts)
    assert [o.num_cached_tokens for o in outs] == cached
    for p, o in zip(prompts, outs, strict=True):
        assert_same(o, solo(ref, p))


def assert_idle_after_flush(eng: LLMEngine) -> None:
    eng.flush_prefix_cache()
    s = eng.stats()
    assert (s.slots_used, s.kv_pages_used, s.prefix_cache_checkpoints) == (0, 0, 0)
    assert s.prefix_cache_pages == 0 and not eng.has_unfinished()


def test_shared_system_prompt_then_different_suffixes(ckpt, ref):
    eng = build_engine(ckpt, dtype="float32", engine_config=config(True))
    check(eng, ref, [SYSTEM + [1, 2, 3]], [0])
    # Suffixes diverge right after the system prompt: the deepest checkpoint is at 32 (the
    # first request's end of prompt, at 43, does not prefix them). The three run together and
    # share the cached pages.
    suffixes = [[9, 8, 7, 6, 5], [200], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]]
    check(eng, ref, [SYSTEM + s for s in suffixes], [32, 32, 32])
    s = eng.stats()
    assert s.prefix_cache_hit_tokens == 96 and s.prefix_cache_query_tokens == 43 + 45 + 41 + 51
    assert_idle_after_flush(eng)


def test_prefix_ending_mid_page_and_whole_and_shorter_prompts(ckpt, ref):
    eng = build_engine(ckpt, dtype="float32", engine_config=config(True))
    first = SYSTEM[:21]  # its end-of-prompt checkpoint is 5 tokens into the third page
    (out,) = drive(eng, [first])
    other = (out.token_ids[0] + 1) % 200  # not the answer: the end-of-generation one is no hit
    check(eng, ref, [first + [other, 4]], [21])  # copy-on-write of the partly filled page
    check(eng, ref, [list(first)], [16])  # a whole earlier prompt: resume before its end
    check(eng, ref, [first[:18]], [16])  # a prefix of a cached prompt stops at its own end
    check(eng, ref, [first[:16]], [0])  # ... and never resumes at it
    check(eng, ref, [first + out.token_ids[:4] + [7]], [25])  # the end of generation
    assert_idle_after_flush(eng)


def test_concurrent_requests_share_pages(ckpt, ref):
    eng = build_engine(ckpt, dtype="float32", engine_config=config(True))
    drive(eng, [SYSTEM])
    prompts = [SYSTEM + [i, i + 1] for i in range(4)]
    for p in prompts:
        eng.add_request(p, G)
    eng.step()  # all four admitted, resumed at the first one's end of prompt (5 whole pages)
    reqs = list(eng.scheduler.running)
    assert len(reqs) == 4 and all(r.num_cached_tokens == 40 for r in reqs)
    shared = reqs[0].pages[:5]
    assert all(r.pages[:5] == shared for r in reqs)
    refs = eng.scheduler.cache_manager.pages.refcount
    assert all(refs(p) == 5 for p in shared)  # 4 requests + the cache
    while eng.has_unfinished():
        eng.step()
    assert all(refs(p) == 1 for p in shared)
    assert_idle_after_flush(eng)


def test_eviction_under_pressure_then_correct_recompute(ckpt, ref):
    # 12 pages of 8 tokens and 4 checkpoint slots: a few prompts fill the cache.
    eng = build_engine(
        ckpt, dtype="float32", engine_config=config(True, num_kv_pages=13, num_checkpoint_slots=4)
    )
    first = SYSTEM[:34]
    check(eng, ref, [first], [0])
    check(eng, ref, [first + [5]], [34])
    for i in range(6):  # other prompts push the first one's entries out
        check(eng, ref, [[100 + i] + SYSTEM[i : i + 30]], [0])
    assert eng.stats().prefix_cache_evictions > 0
    (again,) = drive(eng, [first + [5]])
    assert again.num_cached_tokens < 34
    assert_same(again, solo(ref, first + [5]))
    assert_idle_after_flush(eng)


def test_soak_mixed_cached_uncached_aborted_back_to_idle(ckpt, ref):
    eng = build_engine(ckpt, dtype="float32", engine_config=config(True, num_checkpoint_slots=12))
    rng = random.Random(3)
    heads = [SYSTEM[:24], SYSTEM[10:45], [7] * 20]
    pending: dict[str, list[int]] = {}
    finished: list[tuple[list[int], RequestOutput]] = []
    aborted = 0
    for step in range(60):
        if step < 45 and rng.random() < 0.5:
            if rng.random() < 0.7:
                prompt = rng.choice(heads) + [
                    rng.randrange(1, 250) for _ in range(rng.randint(1, 9))
                ]
            else:  # uncached: a fresh prompt
                prompt = [rng.randrange(1, 250) for _ in range(rng.randint(3, 30))]
            pending[eng.add_request(prompt, G)] = prompt
        if pending and rng.random() < 0.1:
            victim = rng.choice(sorted(pending))
            eng.abort_request(victim)
            pending.pop(victim)
            aborted += 1
        for out in eng.step():
            assert out.error is None, out.error
            if out.finished:
                finished.append((pending.pop(out.request_id), out))
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finished.append((pending.pop(out.request_id), out))
    assert aborted and len(finished) > 10
    assert any(o.num_cached_tokens for _, o in finished)
    for prompt, out in finished:
        assert_same(out, solo(ref, prompt))
    assert_idle_after_flush(eng)
