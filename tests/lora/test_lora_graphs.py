"""Multi-LoRA with graph-captured decode (CPU graphs: the buffer protocol the CUDA graphs
replay, tests/graph_helpers.py), eager and on the Triton path under the interpreter: one batch
mixing three adapters with the bare base equals transformers + PEFT row by row, and its decode
steps were replays reading each row's adapter slot from the static buffer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lora_runs import adapter_dirs, check_mixed_batch, make_oracles, mixed_refs
from triton_path import _forbidden, force_triton_path

from shortconv import LLM
from shortconv.lora import linear as lora_linear
from shortconv.tiny.checkpoint import make_tiny_checkpoint

GRAPHS = dict(enable_graphs=True, graph_batch_sizes=(1, 2, 4, 8), graph_context_sizes=(32, 64))


@pytest.fixture(scope="module", params=["lfm2", "zaya1"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-graphs-{arch}")
    ckpt = make_tiny_checkpoint(arch, root / "base", seed=0)
    oracles = make_oracles(arch, root)
    return arch, ckpt, oracles, root


def _llm(ckpt: Path, oracles: dict, root: Path) -> LLM:
    modules = adapter_dirs(root, oracles)
    return LLM(ckpt, dtype="float32", enable_lora=True, max_loras=3, lora_modules=modules, **GRAPHS)


@pytest.fixture()
def llm_of(case: tuple) -> Iterator:
    made: list[LLM] = []

    def build() -> LLM:
        made.append(_llm(case[1], case[2], case[3]))
        return made[-1]

    yield build
    for llm in made:
        llm.shutdown()


def _replays(llm: LLM) -> int:
    stats = llm.engine.executor.graph_stats()
    assert stats is not None
    return stats.replays


def test_graph_replays_match_peft(case: tuple, llm_of) -> None:
    arch, _, oracles, _ = case
    llm = llm_of()
    check_mixed_batch(llm.engine, oracles, f"{arch} with graphs")
    assert _replays(llm) > 0


def test_triton_path_with_graphs_matches_peft(
    case: tuple, llm_of, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, _, oracles, _ = case
    refs = mixed_refs(oracles)  # before torch's attention is patched away
    calls = force_triton_path(monkeypatch)
    for name in ("add_stacked", "add_grouped"):  # the torch adapter paths: the kernel replaces them
        monkeypatch.setattr(lora_linear, name, _forbidden(f"lora.delta.{name}"))
    llm = llm_of()
    check_mixed_batch(llm.engine, oracles, f"{arch} on the Triton path", refs)
    assert _replays(llm) > 0
    assert calls["paged_attention_decode_triton"] > 0
    assert calls["lora_delta_triton"] > 0
