"""Multi-LoRA at tp_size 2 on Ray (CPU, gloo, real actors): one batch mixing three adapters with
the bare base equals transformers + PEFT row by row, for LFM2, LFM2-MoE, LFM3 and ZAYA1, and
for LFM2 with graph-captured decode on the ranks, and for adapters on LFM2-MoE's and ZAYA1's
routed experts. Each rank holds its
shard of every adapter (B's rows beside a column-parallel weight, A's columns beside a
row-parallel one) and learns each row's adapter slot from the step message. A refused adapter
is refused by every rank and the engine keeps serving; an unload empties the slot on every
rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lora_adapters import EXPERT_PARAMS, make_adapter  # noqa: E402
from lora_runs import GREEDY, adapter_dirs, check_mixed_batch, make_oracles  # noqa: E402
from ray_env import private_ray  # noqa: E402

from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.execution.worker_spec import plan_worker_spec  # noqa: E402
from shortconv.lora.adapter import LoraError  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from workers.ray_executor import RayExecutor  # noqa: E402

pytestmark = pytest.mark.timeout(900)

# 8 query / 2 KV heads: one KV head per rank (ZAYA1: rank 0 the current-token head, rank 1
# the previous-token head, so v_proj_delayed is an empty shard on rank 0).
OVERRIDES = {"num_attention_heads": 8, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[None]:
    with private_ray("sclora-", num_cpus=2):
        yield


@pytest.fixture(scope="module", params=["lfm2", "zaya1", "lfm2_moe", "lfm3"])
def tp2(
    request: pytest.FixtureRequest, ray_runtime: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LLMEngine, dict, Path]]:
    yield from _engine(request.param, tmp_path_factory)


def _engine(
    arch: str, tmp_path_factory: pytest.TempPathFactory, **graphs: object
) -> Iterator[tuple[str, LLMEngine, dict, Path]]:
    root = tmp_path_factory.mktemp(f"lora-tp-{arch}")
    ckpt = make_tiny_checkpoint(arch, root / "base", OVERRIDES, seed=0, with_tokenizer=False)
    oracles = make_oracles(arch, root, OVERRIDES)
    modules = adapter_dirs(root, oracles)
    eng = EngineConfig(enable_lora=True, max_loras=3, lora_modules=modules, **graphs)
    spec = plan_worker_spec(ckpt, eng, "float32", tp_size=2)
    executor = RayExecutor(spec, 2, num_cpus_per_worker=0.25)
    try:
        yield arch, LLMEngine(spec, executor), oracles, root
    finally:
        executor.shutdown()


def test_tp2_mixed_batch_matches_peft(tp2: tuple) -> None:
    arch, engine, oracles, _ = tp2
    check_mixed_batch(engine, oracles, f"{arch} tp_size=2")


def test_tp2_refuses_an_adapter_for_another_base_and_keeps_serving(tp2: tuple) -> None:
    arch, engine, oracles, root = tp2
    other = root / "other"
    make_adapter(arch, other, seed=9, overrides={**OVERRIDES, "hidden_size": 96})
    with pytest.raises(LoraError, match="another base") as refused:
        engine.load_lora("other", str(other))
    assert refused.value.reason == "shape"  # the rank's reason survives Ray (the metrics label)
    assert "other" not in engine.lora_names()
    check_mixed_batch(engine, oracles, f"{arch} tp_size=2 after a refusal")


def _slot_sums(engine: LLMEngine, slot: int) -> list[float]:
    executor = engine.executor
    assert isinstance(executor, RayExecutor)
    return list(executor.call_workers("lora_slot_sum", slot))


def test_tp2_unload_then_reload_on_every_rank(tp2: tuple) -> None:
    """Unloading zeroes the slot on every rank and forgets the name; loading it again writes
    every rank's shard afresh, and the mixed batch still matches PEFT."""
    arch, engine, oracles, root = tp2
    assert engine.loras is not None
    slot = engine.loras.slots.slot_of("a2")
    assert slot is not None
    assert all(s > 0 for s in _slot_sums(engine, slot)), "a2's shard is on every rank"
    engine.unload_lora("a2")
    assert _slot_sums(engine, slot) == [0.0, 0.0], "an unloaded adapter's slot must be empty"
    assert "a2" not in engine.lora_names()
    with pytest.raises(LoraError, match="unknown LoRA adapter"):
        engine.add_request([5, 6], GREEDY, lora_name="a2")
    engine.load_lora("a2", str(root / "a2"))
    check_mixed_batch(engine, oracles, f"{arch} tp_size=2 after unload and reload")


@pytest.fixture(scope="module")
def tp2_graphs(
    ray_runtime: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LLMEngine, dict, Path]]:
    graphs = dict(enable_graphs=True, graph_batch_sizes=(1, 2, 4), graph_context_sizes=(32, 64))
    yield from _engine("lfm2", tmp_path_factory, **graphs)


def test_tp2_with_graphs_matches_peft(tp2_graphs: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks replay their captured decode graphs, each reading the row's adapter slot
    from its static buffer (rank 0 reports `used_graph`)."""
    arch, engine, oracles, _ = tp2_graphs
    executor = engine.executor
    replays = []
    execute = executor.execute

    def counted(plan: object) -> object:
        result = execute(plan)  # type: ignore[arg-type]
        replays.append(result.used_graph)
        return result

    monkeypatch.setattr(executor, "execute", counted)
    check_mixed_batch(engine, oracles, f"{arch} tp_size=2 with graphs")
    assert any(replays), "decode steps must be graph replays on the ranks"


@pytest.mark.parametrize("arch", ["lfm2_moe", "zaya1"])
def test_tp2_expert_adapters_match_peft(
    arch: str, ray_runtime: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """LoRA on the routed experts: each rank holds its shard of every expert adapter (gate_up's
    B rows per gate/up half, down's A columns, as the base experts split their intermediate
    size), and one batch mixing three experts-only adapters with the bare base equals
    transformers + PEFT row by row."""
    root = tmp_path_factory.mktemp(f"lora-experts-tp-{arch}")
    ckpt = make_tiny_checkpoint(arch, root / "base", OVERRIDES, seed=0, with_tokenizer=False)
    oracles = make_oracles(arch, root, OVERRIDES, targets=[], params=EXPERT_PARAMS)
    eng = EngineConfig(enable_lora=True, max_loras=3, lora_modules=adapter_dirs(root, oracles))
    spec = plan_worker_spec(ckpt, eng, "float32", tp_size=2)
    executor = RayExecutor(spec, 2, num_cpus_per_worker=0.25)
    try:
        check_mixed_batch(LLMEngine(spec, executor), oracles, f"{arch} experts tp_size=2")
    finally:
        executor.shutdown()
