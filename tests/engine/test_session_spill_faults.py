"""Session spill and restore when something fails underneath: nothing leaks, nothing crashes.

* A store that cannot save (its directory gone) must not stop the LRU eviction that asked for
  the spill: the turns go on, the failure is counted (`store`), and the evicted session's next
  turn re-prefills with the same answer as a fresh engine (the oracle).
* A restore whose write fails on a dead executor (every rank call raising ExecutorError, as a
  failed RayExecutor does) fails the turn with that error and holds no slot or page.
* `reserve` gives back what it took when an eviction it triggers raises.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from engine_pools import finish, pools

from shortconv.cache.kept_state import reserve
from shortconv.configs.config import EngineConfig
from shortconv.engine.executor import ExecutorError
from shortconv.engine.llm_engine import LLMEngine
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

G = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
P1 = [7, 31, 99, 140, 203, 11, 58, 77, 301, 12, 19, 44, 250, 3, 88, 91, 17]
DEAD = "tensor-parallel executor failed: TP rank 1 died (injected)"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=11)


def engine(ckpt: Path, store: dict[str, str] | None = None, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(enable_prefix_caching=False, kv_page_size=4, session_store=store, **kw)
    return build_engine(ckpt, dtype="float32", engine_config=cfg)


def run(eng: LLMEngine, prompt: list[int], session: str | None = None) -> Any:
    return finish(eng, prompt, G, session)


def prompt_of(sid: str) -> list[int]:
    return [t + ord(sid) for t in P1]


def test_store_that_cannot_save_never_stops_an_eviction(ckpt: Path, tmp_path: Path) -> None:
    store = {"path": str(tmp_path / "store")}
    eng = engine(ckpt, store, max_num_seqs=1, num_state_slots=5)  # a third session evicts
    shutil.rmtree(store["path"])  # the volume went away: every save raises OSError
    firsts = {}
    for sid in ("a", "b", "c"):
        out = run(eng, prompt_of(sid), sid)
        assert out.error is None, out.error
        firsts[sid] = list(out.token_ids)
    counters = eng.session_state.counters
    assert counters.refused["store"] >= 1 and counters.events["spilled"] == 0
    assert "a" not in eng.sessions  # evicted all the same
    pa = prompt_of("a") + firsts["a"] + [5]
    got = run(eng, pa, "a")
    ref = run(engine(ckpt), pa)
    assert got.num_cached_tokens == 0  # nothing was saved: a full prefill
    assert (got.token_ids, got.logprobs) == (ref.token_ids, ref.logprobs)


def test_restore_on_a_dead_executor_fails_the_turn_and_holds_nothing(
    ckpt: Path, tmp_path: Path
) -> None:
    store = {"path": str(tmp_path / "store")}
    one = engine(ckpt, store)
    out1 = run(one, P1, "s")
    one.shutdown()  # spills "s"
    two = engine(ckpt, store)
    before = pools(two)

    def dead(*_: Any) -> Any:
        raise ExecutorError(DEAD)

    two.executor.write_state = dead  # type: ignore[method-assign]
    two.executor.execute = dead  # type: ignore[method-assign]
    out = run(two, P1 + list(out1.token_ids) + [40, 41], "s")
    assert out.error is not None and "TP rank 1 died" in out.error
    assert pools(two) == before
    assert two.session_state.counters.refused["executor"] == 1


def test_reserve_gives_back_when_an_eviction_raises(ckpt: Path) -> None:
    eng = engine(ckpt, max_num_seqs=1, num_state_slots=5)
    assert run(eng, P1, "a").error is None  # "a" pins two of the four slots
    cm = eng.scheduler.cache_manager
    before = pools(eng)
    assert cm.slots.num_free == 2

    def spill(_: str) -> None:
        raise RuntimeError("spill failed")

    cm.spill = spill
    with pytest.raises(RuntimeError, match="spill failed"):
        reserve(cm, 3, [1])  # two free slots taken, the third evicts "a": spill raises
    assert pools(eng) == before
