"""Session state kept across turns in the engine: resume equals recompute, LRU eviction, release.

Every test runs twice: with prefix caching (the default: a session is a pin on the cache's
checkpoints) and without it (the session store keeps the checkpoints itself)."""

from __future__ import annotations

import pytest

from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

G = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=11)


@pytest.fixture(params=[True, False], ids=["prefix-cache", "session-store"])
def caching(request) -> bool:
    return request.param


def engine(ckpt, caching: bool, **kw) -> LLMEngine:
    cfg = EngineConfig(enable_prefix_caching=caching, **kw)
    return build_engine(ckpt, dtype="float32", engine_config=cfg)


def release_all(eng: LLMEngine) -> None:
    """Drop every kept session (and, with prefix caching, every cached entry)."""
    while eng.sessions.evict_lru():
        pass
    eng.flush_prefix_cache()


def run(eng: LLMEngine, prompt: list[int], session: str | None = None) -> tuple[list[int], int]:
    rid = eng.add_request(prompt, G, session_id=session)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out.token_ids, out.num_cached_tokens


def test_resume_from_generation_equals_recompute(ckpt, caching):
    eng = engine(ckpt, caching, max_num_batched_tokens=8)
    ref = engine(ckpt, False)
    p1 = [5, 9, 13, 17, 21, 25, 29]
    out1, cached1 = run(eng, p1, "s")
    assert cached1 == 0
    # All generated tokens but the last were folded into state; the last is the new suffix.
    p2 = p1 + out1 + [40, 41, 42]
    out2, cached2 = run(eng, p2, "s")
    assert cached2 == len(p1) + len(out1) - 1
    assert out2 == run(ref, p2)[0]
    p3 = p2 + out2 + [50]
    out3, cached3 = run(eng, p3, "s")
    assert cached3 == len(p2) + len(out2) - 1 and out3 == run(ref, p3)[0]


def test_resume_from_prompt_checkpoint_when_answer_rerendered(ckpt, caching):
    eng = engine(ckpt, caching)
    ref = engine(ckpt, False)
    p1 = [5, 9, 13, 17, 21, 25, 29, 33, 37]
    out1, _ = run(eng, p1, "s")
    different_answer = [(t + 1) % 500 for t in out1]
    p2 = p1 + different_answer + [60, 61]
    out2, cached2 = run(eng, p2, "s")
    assert cached2 == len(p1)
    assert out2 == run(ref, p2)[0]


def test_mismatch_is_full_prefill_and_other_sessions_unaffected(ckpt, caching):
    eng = engine(ckpt, caching)
    ref = engine(ckpt, False)
    a1, _ = run(eng, [5, 6, 7, 8], "a")
    run(eng, [9, 10, 11], "b")
    out, cached = run(eng, [100, 101, 102], "a")
    assert cached == 0 and out == run(ref, [100, 101, 102])[0]
    pb = [9, 10, 11] + [1, 2, 3]
    outb, cachedb = run(eng, pb, "b")
    assert cachedb == 0 or outb == run(ref, pb)[0]


def test_lru_eviction_under_slot_pressure_and_release(ckpt, caching):
    kw = dict(max_num_seqs=2, num_state_slots=5, max_num_batched_tokens=64)
    eng = engine(ckpt, caching, num_checkpoint_slots=1, **kw)
    ref = engine(ckpt, False)
    sched = eng.scheduler.cache_manager
    for i in range(6):  # far more sessions than spare slots: older ones are evicted
        out, _ = run(eng, [5 + i, 6, 7, 8], f"s{i}")
        assert out == run(ref, [5 + i, 6, 7, 8])[0]
    assert sched.sessions.evictions > 0
    assert sched.slots.num_used <= sched.slots.capacity
    # The newest session survived and resumes.
    p = [10, 6, 7, 8] + out + [1]
    out2, cached = run(eng, p, "s5")
    assert cached > 0 and out2 == run(ref, p)[0]
    release_all(eng)
    assert sched.slots.num_used == 0 and sched.pages.num_used == 0


def test_stats_track_occupancy_and_return_to_idle(ckpt, caching):
    eng = engine(ckpt, caching)
    idle = eng.stats()
    assert idle.slots_used == 0 and idle.kv_pages_used == 0 and idle.pools[0] == "conv"
    eng.add_request([5, 6, 7], G, session_id="x")
    eng.step()
    busy = eng.stats()
    assert busy.slots_used >= 1 and busy.kv_pages_used >= 1 and busy.num_running == 1
    while eng.has_unfinished():
        eng.step()
    kept = eng.stats()
    assert kept.sessions_held == 1 and kept.finished_by_reason == {"length": 1}
    assert kept.prompt_tokens_total == 3 and kept.generation_tokens_total == 6
    eng.add_request([1, 2], G, request_id="gone")
    eng.step()
    eng.abort_request("gone")
    eng.sessions.drop("x")
    eng.flush_prefix_cache()
    idle = eng.stats()
    assert idle.slots_used == 0 and idle.kv_pages_used == 0 and idle.sessions_held == 0
    assert idle.finished_by_reason == {"length": 1, "abort": 1}


def test_waiting_request_counts_one_session_miss(ckpt, caching):
    eng = engine(ckpt, caching, max_num_seqs=1)
    eng.add_request([5, 6, 7], G)
    eng.add_request([8, 9], G, session_id="new")  # waits behind the first for several steps
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().session_misses == 1
