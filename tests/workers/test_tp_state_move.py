"""A session's state moves across TP degrees: exported at TP 2 (real Ray actors, gloo) and
imported at TP 1, and the reverse, it continues as one engine serving both turns does.

The bundle carries the unsharded layout (`execution.state_shards`): export gathers both ranks'
shards of the conv/CCA state and of the KV heads, import cuts them back out. LFM2 and ZAYA1
here have 8 query / 2 KV heads, so at TP 2 each rank holds one KV head and half the conv
channels (ZAYA1: its own q‖k conv channels, and rank 1 the whole previous-token state).

Oracle: the same two turns on one engine at the importing side's degree (itself checked
against TP 1 and transformers in tests/workers/test_tp.py), token for token with logprobs,
except past a near-tie (summation order differs between degrees). A bundle with one rank's
conv window shifted by a token on import must fail it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from test_tp import assert_same_greedy, engine_config, ray_runtime  # noqa: E402, F401

from shortconv.configs.hf.availability import transformers_lacks  # noqa: E402
from shortconv.engine.executor import BaseExecutor  # noqa: E402
from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.engine.outputs import RequestOutput  # noqa: E402
from shortconv.execution.local_executor import LocalExecutor  # noqa: E402
from shortconv.execution.worker_spec import WorkerSpec, plan_worker_spec  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from workers.ray_executor import RayExecutor  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
HEADS = {"num_attention_heads": 8, "num_key_value_heads": 2}
SEEDS = {"lfm2": 11, "zaya1": 5}  # greedy output that varies with the state
P1 = [int(t) for t in torch.randint(4, 500, (23,), generator=torch.Generator().manual_seed(3))]


@dataclass
class Pair:
    """One checkpoint's TP 1 and TP 2 executors; `engine(tp)` is a fresh engine over one."""

    spec: WorkerSpec
    executors: dict[int, BaseExecutor]

    def engine(self, tp: int) -> LLMEngine:
        # NOTE: test_tp's fixed pool sizes: the engines of one degree share its executor.
        return LLMEngine(replace(self.spec, engine_cfg=engine_config()), self.executors[tp])


@pytest.fixture(scope="module", params=["lfm2", "zaya1"])
def pair(request, ray_runtime, tmp_path_factory) -> Iterator[Pair]:  # noqa: F811 (test_tp's)
    arch = request.param
    if arch == "zaya1" and (reason := transformers_lacks("zaya")):
        pytest.skip(reason)
    ckpt: Path = make_tiny_checkpoint(
        arch, tmp_path_factory.mktemp(arch), HEADS, seed=SEEDS[arch], with_tokenizer=False
    )
    spec = plan_worker_spec(ckpt, engine_config(), "float32")
    tp2 = RayExecutor(spec, 2, num_cpus_per_worker=0.5)
    yield Pair(spec, {1: LocalExecutor(spec), 2: tp2})
    tp2.shutdown()


def run(eng: LLMEngine, prompt: list[int]) -> RequestOutput:
    rid = eng.add_request(prompt, GREEDY, session_id="s")
    while True:
        for out in eng.step():
            assert out.error is None, out.error
            if out.request_id == rid and out.finished:
                return out


def two_turns(pair: Pair, tp: int) -> tuple[RequestOutput, list[int]]:
    """Both turns on one engine at `tp`: turn 2's output and its prompt."""
    eng = pair.engine(tp)
    p2 = P1 + list(run(eng, P1).token_ids) + [40, 41, 42]
    return run(eng, p2), p2


def moved(pair: Pair, src: int, dst: int) -> tuple[RequestOutput, list[int]]:
    """Turn 1 at `src`, its session exported and imported at `dst`, turn 2 there."""
    a = pair.engine(src)
    p2 = P1 + list(run(a, P1).token_ids) + [40, 41, 42]
    bundle = a.export_session("s")
    assert bundle is not None
    b = pair.engine(dst)
    assert b.import_session("s", bundle), dict(b.session_state.counters.refused)
    out = run(b, p2)
    assert out.num_cached_tokens == len(P1) + GREEDY.max_tokens - 1  # resumed, not recomputed
    return out, p2


@pytest.mark.parametrize(("src", "dst"), [(2, 1), (1, 2)])
def test_session_moved_across_tp_degrees_equals_one_engine(pair: Pair, src: int, dst: int) -> None:
    got, p2 = moved(pair, src, dst)
    ref, ref_p2 = two_turns(pair, dst)
    assert p2 == ref_p2  # turn 1 agreed across degrees, so turn 2's prompts are one prompt
    assert_same_greedy(got, ref)


def test_oracle_bites_on_one_ranks_window_shifted(pair: Pair, monkeypatch) -> None:
    """Rank 1's conv window moved back one token on import (TP 1 → TP 2) must be caught."""
    tp2 = pair.executors[2]
    assert isinstance(tp2, RayExecutor)
    scatter = type(tp2._shards).scatter

    def shifted(self, tensors):
        parts = scatter(self, tensors)
        conv = parts[1]["conv"].clone()
        conv[0] = torch.cat([torch.zeros_like(conv[0][..., :1]), conv[0][..., :-1]], dim=-1)
        parts[1]["conv"] = conv
        return parts

    monkeypatch.setattr(type(tp2._shards), "scatter", shifted)
    got, _ = moved(pair, 1, 2)
    monkeypatch.undo()
    ref, _ = two_turns(pair, 2)
    with pytest.raises(AssertionError):
        assert_same_greedy(got, ref)
