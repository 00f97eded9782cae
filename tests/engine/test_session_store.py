"""Durable sessions: state spilled to files (LRU eviction, shutdown) resumes in a later engine.

The oracle is the same engine recomputing the whole prompt with no kept state; a refused file
(corrupt, from another checkpoint) must leave the turn re-prefilled with equal output."""

from __future__ import annotations

import os
import time

import pytest

from shortconv.configs.config import EngineConfig
from shortconv.configs.session_store import SessionStoreConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.session_store import SessionStore
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

G = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
P1 = [7, 31, 99, 140, 203, 11, 58, 77, 301, 12, 19, 44, 250, 3, 88, 91, 17]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=11)


def engine(ckpt, store=None, **kw) -> LLMEngine:
    cfg = EngineConfig(enable_prefix_caching=False, kv_page_size=4, session_store=store, **kw)
    return build_engine(ckpt, dtype="float32", engine_config=cfg)


def run(eng: LLMEngine, prompt: list[int], session: str | None = None):
    rid = eng.add_request(prompt, G, session_id=session)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return (out.token_ids, [round(x or 0.0, 4) for x in out.logprobs or ()]), (
                    out.num_cached_tokens
                )


def test_restart_resumes_from_the_store(ckpt, tmp_path):
    store = {"path": str(tmp_path / "store")}
    one = engine(ckpt, store)
    (out1, _), _ = run(one, P1, "s")
    one.shutdown()
    assert one.session_state.counters.events["spilled"] == 1
    p2 = P1 + out1 + [40, 41]
    two = engine(ckpt, store)
    got, cached = run(two, p2, "s")
    assert cached == len(P1) + len(out1) - 1
    assert got == run(engine(ckpt), p2)[0]
    assert two.session_state.counters.events["restored"] == 1


def test_lru_eviction_spills_and_the_session_comes_back(ckpt, tmp_path):
    store = {"path": str(tmp_path / "store")}
    # One running sequence and few slots: a third session's turn evicts the first's pins.
    eng = engine(ckpt, store, max_num_seqs=1, num_state_slots=5)
    firsts = {}
    for sid in ("a", "b", "c"):
        firsts[sid] = run(eng, [t + ord(sid) for t in P1], sid)[0][0]
    assert eng.session_state.counters.events["spilled"] >= 1 and "a" not in eng.sessions
    pa = [t + ord("a") for t in P1] + firsts["a"] + [5]
    got, cached = run(eng, pa, "a")
    assert cached == len(P1) + len(firsts["a"]) - 1
    assert got == run(engine(ckpt), pa)[0]


def _spill_one(ckpt, store) -> list[int]:
    one = engine(ckpt, store)
    (out1, _), _ = run(one, P1, "s")
    one.shutdown()
    return P1 + out1 + [40, 41]


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_checkpoint"])
def test_bad_file_is_refused_and_reprefilled(ckpt, tmp_path, damage):
    store = {"path": str(tmp_path / "store")}
    p2 = _spill_one(ckpt, store)
    path = SessionStore(SessionStoreConfig(**store)).file_of("s")
    data = bytearray(path.read_bytes())
    reason = "checksum"
    if damage == "flip":
        data[len(data) // 3] ^= 0x04
    elif damage == "truncate":
        del data[len(data) // 2 :]
    else:
        other = make_tiny_checkpoint("lfm2", tmp_path / "other", seed=12)
        _spill_one(other, store)  # the same session id, another model's state
        data, reason = bytearray(path.read_bytes()), "fingerprint"
    path.write_bytes(bytes(data))
    two = engine(ckpt, store)
    got, cached = run(two, p2, "s")
    assert cached == 0 and got == run(engine(ckpt), p2)[0]
    assert two.session_state.counters.refused == {reason: 1}
    assert not path.exists()


def test_expired_and_over_limit_files_are_removed(tmp_path):
    cfg = SessionStoreConfig(str(tmp_path), ttl_s=60.0, max_bytes=250)
    store = SessionStore(cfg)
    for i, sid in enumerate(["old", "a", "b", "c"]):
        store.save(sid, b"x" * 100)
        stamp = time.time() - (1000 if sid == "old" else 10 - i)
        os.utime(store.file_of(sid), (stamp, stamp))
    store.prune()
    assert not store.file_of("old").exists()  # expired
    assert not store.file_of("a").exists()  # the oldest of what is over the cap
    assert store.file_of("b").exists() and store.file_of("c").exists()
    os.utime(store.file_of("c"), (time.time() - 100, time.time() - 100))
    assert store.load("c") is None and not store.file_of("c").exists()
