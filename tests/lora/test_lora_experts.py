"""LoRA on the fused routed experts of LFM2-MoE and ZAYA1 (PEFT's `target_parameters` on
`experts.gate_up_proj` / `experts.down_proj`): greedy parity with transformers + PEFT, each
adapter alone and one batch mixing three experts-only adapters with the bare base; what the
engine does not serve is refused at load, leaving the engine as it was."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import EXPERT_PARAMS, make_adapter
from lora_runs import (
    MAX_NEW,
    PROMPTS,
    adapter_dirs,
    check_mixed_batch,
    make_oracles,
    mixed_refs,
    run_all,
)
from oracle import assert_matches_oracle, oracle_greedy
from triton_path import force_triton_path

from shortconv import LLM
from shortconv.configs.config import ModelConfig
from shortconv.execution.parallel import ParallelContext
from shortconv.layers.experts import FusedExperts
from shortconv.lora.adapter import LoraError, read_adapter
from shortconv.lora.batch import LoraBatch
from shortconv.lora.experts import bind_expert_lora
from shortconv.lora.install_experts import expert_targets
from shortconv.models.build import build_model
from shortconv.models.registry import model_class
from shortconv.tiny.checkpoint import make_tiny_checkpoint

ARCHS = ["lfm2_moe", "zaya1"]
GRAPHS = dict(enable_graphs=True, graph_batch_sizes=(1, 2, 4, 8), graph_context_sizes=(32, 64))


@pytest.fixture(scope="module", params=ARCHS)
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple]:
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-experts-{arch}")
    ckpt = make_tiny_checkpoint(arch, root / "base", seed=0)
    # a0..a2 adapt the experts only, so the mixed batch shows the experts' adapters alone.
    oracles = make_oracles(arch, root, targets=[], params=EXPERT_PARAMS)
    # One parameter alone (no nesting in PEFT's names), rsLoRA at rank 8.
    oracles["down"] = make_adapter(
        arch,
        root / "down",
        seed=7,
        rank=8,
        targets=[],
        params=["experts.down_proj"],
        use_rslora=True,
    )
    # The experts beside every dense projection PEFT targets.
    oracles["all"] = make_adapter(arch, root / "all", seed=8, params=EXPERT_PARAMS)
    llm = LLM(
        ckpt,
        dtype="float32",
        enable_lora=True,
        max_loras=5,
        lora_modules=adapter_dirs(root, oracles),
    )
    yield arch, llm, oracles, root
    llm.shutdown()


def test_peft_names_each_expert_parameter(setup: tuple) -> None:
    """PEFT names a module's two wrapped parameters by nesting depth; the engine maps them back
    to the parameters, with the expert count, and the rank per expert."""
    arch, llm, _, root = setup
    modules = read_adapter(root / "a0").modules
    experts = [m for m in modules if m.endswith(("gate_up_proj", "down_proj"))]
    assert experts and len(experts) == len(modules)
    assert {m.rpartition(".")[2] for m in experts} == {"gate_up_proj", "down_proj"}
    assert {t.experts for t in modules.values()} == {llm.engine.model_cfg.num_experts}
    assert {t.rank for t in modules.values()} == {4}
    down = read_adapter(root / "down").modules
    assert all(m.endswith("experts.down_proj") for m in down) and {
        t.rank for t in down.values()
    } == {8}


def test_each_adapter_alone_matches_peft(setup: tuple) -> None:
    arch, llm, oracles, _ = setup
    for name in ("a0", "down", "all"):
        ours = run_all(llm.engine, [(PROMPTS[0], name)])[0]
        ref = oracle_greedy(oracles[name], PROMPTS[0], MAX_NEW)
        assert_matches_oracle(ours, ref, f"{arch} expert adapter {name}")


def test_a_batch_mixing_three_expert_adapters_and_the_base(setup: tuple) -> None:
    arch, llm, oracles, _ = setup
    check_mixed_batch(llm.engine, oracles, f"{arch} experts")


def _experts(llm: LLM) -> list[FusedExperts]:
    model = llm.engine.executor.runner.model  # type: ignore[attr-defined]
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


def _assert_unchanged(llm: LLM, names: list[str], before: list[int]) -> None:
    assert llm.engine.lora_names() == names
    assert llm.engine.loras is not None and set(llm.engine.loras.slots.resident) <= set(names)
    assert run_all(llm.engine, [(PROMPTS[0], "a0")])[0] == before


def test_an_adapter_for_other_experts_is_refused(setup: tuple) -> None:
    arch, llm, _, root = setup
    names = llm.engine.lora_names()
    before = run_all(llm.engine, [(PROMPTS[0], "a0")])[0]
    other = root / "other"
    make_adapter(
        arch, other, seed=9, targets=[], params=EXPERT_PARAMS, overrides={"num_experts": 8}
    )
    with pytest.raises(LoraError, match=r"experts\.(gate_up|down)_proj has 8 experts, this"):
        llm.engine.load_lora("other", str(other))
    _assert_unchanged(llm, names, before)


def test_experts_that_cannot_take_an_adapter_refuse_it_at_load(setup: tuple) -> None:
    """Where the experts' path has no adapter (bound at build: the Triton fused MoE), an
    adapter on them is refused naming the module and the reason; nothing is written."""
    arch, llm, _, root = setup
    names = llm.engine.lora_names()
    before = run_all(llm.engine, [(PROMPTS[0], "a0")])[0]
    experts = _experts(llm)
    saved = [m.lora for m in experts]
    for m in experts:
        assert m.lora is not None and m.lora.refusal is None
        m.lora = dataclasses.replace(m.lora, refusal="no expert LoRA on this path")
    try:
        with pytest.raises(LoraError, match=r"experts\.(gate_up|down)_proj: routed experts cannot"):
            llm.engine.load_lora("refused", str(root / "a1"))
    finally:
        for m, lora in zip(experts, saved, strict=True):
            m.lora = lora
    _assert_unchanged(llm, names, before)


def test_the_triton_path_binds_the_kernel_and_the_flat_layout(
    setup: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the Triton backend the experts bind the fused MoE with LoRA and store each
    (expert, slot) pair as flat slot e * max_loras + s: a load written through the
    rank-major view lands there."""
    pytest.importorskip("triton")
    from shortconv.kernels.moe_lora_triton import fused_moe_lora_triton

    _, _, _, root = setup
    monkeypatch.setenv("SHORTCONV_KERNELS", "triton")
    cfg = ModelConfig.from_dir(root / "base")
    model = build_model(model_class(cfg.arch), cfg, ParallelContext(), "cpu", torch.float32)
    bind_expert_lora(model, LoraBatch(3, 4, torch.device("cpu")))
    targets = expert_targets(model)
    assert targets and {t.refusal for t in targets.values()} == {None}
    m = next(m for m in model.modules() if isinstance(m, FusedExperts))
    assert m.lora is not None and m.lora.moe_kernel is fused_moe_lora_triton  # type: ignore[attr-defined]
    slots = m.lora.gate_up
    num_e, (out_f, in_f) = slots.num_experts, slots.local_shape()
    a, b = torch.randn(2 * num_e, in_f), torch.randn(out_f, 2 * num_e)
    slots.write(1, a, b, 0.5)
    a_flat, b_flat = slots.flat
    for e in range(num_e):
        assert torch.equal(a_flat[e * 3 + 1, :2], a[2 * e : 2 * e + 2])
        assert torch.equal(b_flat[e * 3 + 1, :, :2], b[:, e::num_e] * 0.5)
        assert not a_flat[e * 3 + 2].any() and not b_flat[e * 3].any()


def _triton_llm(
    root: Path, names: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, **graphs: Any
) -> tuple[LLM, Counter[str]]:
    """An engine on SHORTCONV_KERNELS=triton under the interpreter (tests/triton_path.py: the
    torch expert paths raise), and the counts of the Triton kernels it then calls, the fused
    MoE with LoRA among them (`moe_lora`; the experts bind it at build, so spied first)."""
    pytest.importorskip("triton")
    from shortconv.kernels import moe_lora_triton

    calls = force_triton_path(monkeypatch)
    real = moe_lora_triton.fused_moe_lora_triton

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["moe_lora"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_lora_triton, "fused_moe_lora_triton", spy)
    modules = {n: str(root / n) for n in names}
    base = root / "base"
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, lora_modules=modules, **graphs)
    return llm, calls


def test_triton_path_adapter_alone_matches_peft(
    setup: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHORTCONV_KERNELS=triton, eager: the adapter on the experts and every dense
    projection equals PEFT, its experts run by the fused MoE with LoRA."""
    arch, _, oracles, root = setup
    ref = oracle_greedy(oracles["all"], PROMPTS[0], MAX_NEW)  # before SDPA is patched away
    llm, calls = _triton_llm(root, ("all",), monkeypatch)
    try:
        ours = run_all(llm.engine, [(PROMPTS[0], "all")])[0]
        assert_matches_oracle(ours, ref, f"{arch} on the Triton path: expert adapter alone")
        assert calls["moe_lora"] > 0
    finally:
        llm.shutdown()


def test_triton_path_mixed_batch_with_graphs_matches_peft(
    setup: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHORTCONV_KERNELS=triton, graphs on: three expert adapters and the bare base in one
    batch (eager mixed prefill, then captured decode from the static slot buffer), each row
    equal to its own adapter's PEFT oracle, the base row to the base."""
    arch, _, oracles, root = setup
    refs = mixed_refs(oracles)
    llm, calls = _triton_llm(root, ("a0", "a1", "a2"), monkeypatch, **GRAPHS)
    try:
        check_mixed_batch(llm.engine, oracles, f"{arch} on the Triton path with graphs", refs)
        stats = llm.engine.executor.graph_stats()
        assert stats is not None and stats.replays > 0
        assert calls["moe_lora"] > 0
    finally:
        llm.shutdown()


def test_graph_captured_decode_matches_peft(setup: tuple) -> None:
    """Captured decode runs every expert on every row (fixed shapes); each row's adapter is
    masked in from the static slot buffer, and the replays equal PEFT row by row."""
    arch, _, oracles, root = setup
    mixed = {n: str(root / n) for n in ("a0", "a1", "a2")}
    llm = LLM(
        root / "base", dtype="float32", enable_lora=True, max_loras=3, lora_modules=mixed, **GRAPHS
    )
    try:
        check_mixed_batch(llm.engine, oracles, f"{arch} experts with graphs")
        stats = llm.engine.executor.graph_stats()
        assert stats is not None and stats.replays > 0
    finally:
        llm.shutdown()
