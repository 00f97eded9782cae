"""The LoRA parity tests' shared run: one batch mixing three adapters with the bare base, each
row against its own transformers + PEFT oracle (tests/lora_adapters.py makes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lora_adapters import make_adapter
from oracle import OracleRun, assert_matches_oracle, oracle_greedy

from shortconv import SamplingParams
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import RequestOutput
from shortconv.tiny.checkpoint import build_hf_model

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5, 9, 13, 20, 33, 7, 2], [7, 8, 40, 41, 42], [100, 3, 17], [11] * 21]
MIXED = ["a0", None, "a1", "a2"]  # one row per prompt: three adapters and the bare base

Oracles = dict[str | None, torch.nn.Module]


def make_oracles(arch: str, root: Path, overrides: dict | None = None, **adapter: Any) -> Oracles:
    """Adapters a0..a2 saved under `root` (rank 4, distinct seeds; `adapter`: make_adapter's
    other options) and the bare base, each with its transformers + PEFT model: the oracles of
    `check_mixed_batch`."""
    oracles: Oracles = {
        f"a{i}": make_adapter(arch, root / f"a{i}", seed=i, overrides=overrides, **adapter)
        for i in range(3)
    }
    oracles[None] = build_hf_model(arch, overrides, seed=0).eval()
    return oracles


def adapter_dirs(root: Path, oracles: Oracles) -> dict[str, str]:
    """EngineConfig.lora_modules for `make_oracles`' adapters."""
    return {name: str(root / name) for name in oracles if name is not None}


def run_all(engine: LLMEngine, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Queue every (prompt, adapter) at once and step them together to the end."""
    ids = [engine.add_request(p, GREEDY, lora_name=name) for p, name in jobs]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out
    return [done[i].token_ids for i in ids]


def mixed_refs(oracles: Oracles) -> list[OracleRun]:
    """The oracle's tokens for each row of the mixed batch (before anything patches torch's
    attention away: tests/triton_path.py), checking that the adapters really differ on one
    prompt, so a row served by the wrong adapter, or by none, is caught."""
    crossed = [oracle_greedy(oracles[n], PROMPTS[0], MAX_NEW).tokens for n in ("a0", "a1", None)]
    assert len({tuple(t) for t in crossed}) == 3, "the adapters must change the tokens"
    return [oracle_greedy(oracles[n], p, MAX_NEW) for p, n in zip(PROMPTS, MIXED, strict=True)]


def check_mixed_batch(
    engine: LLMEngine, oracles: Oracles, what: str, refs: list[OracleRun] | None = None
) -> None:
    """Each row of one batch mixing three adapters with the bare base equals its own
    adapter's oracle (`refs`: `mixed_refs(oracles)` computed earlier)."""
    refs = refs if refs is not None else mixed_refs(oracles)
    ours = run_all(engine, list(zip(PROMPTS, MIXED, strict=True)))
    for got, ref, name in zip(ours, refs, MIXED, strict=True):
        assert_matches_oracle(got, ref, f"{what}: row with adapter {name}")
