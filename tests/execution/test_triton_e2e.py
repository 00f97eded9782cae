"""The GPU (Triton) path end to end, on CPU: `SHORTCONV_KERNELS=triton` + `TRITON_INTERPRET=1`.

Tiny LFM2, LFM2-MoE, LFM3 and ZAYA1 checkpoints give transformers' greedy tokens through the Triton
short-conv, CCA and paged-attention kernels: a batch under chunked prefill (decode rows mixed
with prefill chunks), requests joining mid-run, and a resumed session. While our engine runs,
torch's SDPA is never called; the Triton attention kernels are (counted), so the interpreter
really tests what a GPU runs. The MoE models route every expert through
the fused-MoE kernel and none through a torch path, and no step builds the torch attention
path's dense gather or mask.

The oracle is the in-memory transformers model (a ZAYA reload would reset its skip bias, see
shortconv/tiny/checkpoint.py) and runs BEFORE the counters are installed: it uses SDPA itself.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.nn.functional as F
from oracle import OracleRun, assert_matches_oracle, oracle_greedy
from triton_path import force_triton_path

from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import build_hf_model

pytest.importorskip("triton")

ARCHS = ("lfm2", "lfm2_moe", "lfm3", "zaya1")
LENGTHS = (1, 6, 19, 33)
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# ZAYA1: a raised skip-class bias so some tokens really take the skip route. Fewer layers than
# the tiny presets (each costs the interpreter seconds), still two of every stateful kind, so a
# layer reading another layer's state would show.
OVERRIDES: dict[str, dict[str, Any]] = {
    "zaya1": {"skip_bias": 0.05, "num_hidden_layers": 2},
    "lfm2": {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention"] * 2},
    "lfm3": {
        "num_hidden_layers": 4,
        "layer_types": ["conv", "sliding_attention", "conv", "full_attention"],
    },
}
_SDPA = F.scaled_dot_product_attention  # the oracle's, restored around its runs


class Case:
    """One architecture: its checkpoint, prompts and (lazily) the oracle's greedy runs."""

    def __init__(self, arch: str, tmp: Path) -> None:
        self.arch = arch
        self.hf = build_hf_model(arch, dict(OVERRIDES.get(arch, {})), seed=21)
        self.hf.save_pretrained(str(tmp))
        self.path = tmp
        rng = random.Random(len(arch))
        self.prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
        self._runs: dict[tuple[int, ...], OracleRun] = {}

    def oracle(self, prompt: list[int]) -> OracleRun:
        key = tuple(prompt)
        if key not in self._runs:
            self._runs[key] = oracle_greedy(self.hf, prompt, MAX_NEW)
        return self._runs[key]


@pytest.fixture(scope="module", params=ARCHS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    c = Case(request.param, tmp_path_factory.mktemp(request.param))
    for p in c.prompts:
        c.oracle(p)
    return c


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    yield force_triton_path(monkeypatch)


def _run(eng: LLMEngine, prompt: list[int], session: str | None) -> tuple[list[int], int]:
    rid = eng.add_request(prompt, GREEDY, session_id=session)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out.token_ids, out.num_cached_tokens


def test_greedy_parity_on_the_triton_path(case: Case, triton_path: Counter[str]) -> None:
    # Budget 8: long prompts are prefilled in chunks while earlier requests decode (mixed steps).
    eng = build_engine(
        case.path, dtype="float32", engine_config=EngineConfig(max_num_batched_tokens=8)
    )
    ids: dict[str, int] = {}
    done: dict[str, list[int]] = {}
    pending, steps = list(range(len(case.prompts))), 0
    while pending or eng.has_unfinished():
        if pending and steps % 2 == 0:  # joins land mid-prefill and mid-decode of the others
            i = pending.pop(0)
            ids[eng.add_request(case.prompts[i], GREEDY)] = i
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        steps += 1
    for rid, toks in done.items():
        prompt = case.prompts[ids[rid]]
        assert_matches_oracle(toks, case.oracle(prompt), f"{case.arch} len={len(prompt)}")
    assert len(done) == len(case.prompts)

    first = case.prompts[2]
    out1, cached1 = _run(eng, first, "s")
    second = first + out1 + [7, 8, 9]
    out2, cached2 = _run(eng, second, "s")
    assert cached1 == 0 and cached2 == len(first) + len(out1) - 1  # resumed, not re-prefilled
    assert_matches_oracle(out2, _oracle_outside(case, second), f"{case.arch} resumed")

    _assert_kernels_ran(triton_path, case.arch)


def _oracle_outside(case: Case, prompt: list[int]) -> OracleRun:
    """The oracle needs torch's SDPA, which the test forbids for the engine: lift it meanwhile."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", _SDPA)
        return case.oracle(prompt)


def _assert_kernels_ran(calls: Counter[str], arch: str) -> None:
    assert calls["paged_attention_decode_triton"] > 0, calls
    assert calls["paged_attention_extend_triton"] > 0, calls
    if arch in ("lfm2_moe", "zaya1"):
        assert calls["fused_moe_triton"] > 0, calls
