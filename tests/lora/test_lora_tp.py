"""Multi-LoRA at tp_size 2 on Ray (CPU, gloo, real actors): one batch mixing three adapters with
the bare base equals transformers + PEFT row by row, for LFM2 and ZAYA1. Each rank holds its
shard of every adapter (B's rows beside a column-parallel weight, A's columns beside a
row-parallel one) and learns each row's adapter slot from the step message. A refused adapter
is refused by every rank and the engine keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lora_adapters import make_adapter  # noqa: E402
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


@pytest.fixture(scope="module", params=["lfm2", "zaya1"])
def tp2(
    request: pytest.FixtureRequest, ray_runtime: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LLMEngine, dict, Path]]:
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-tp-{arch}")
    ckpt = make_tiny_checkpoint(arch, root / "base", OVERRIDES, seed=0, with_tokenizer=False)
    oracles = make_oracles(arch, root, OVERRIDES)
    eng = EngineConfig(enable_lora=True, max_loras=3, lora_modules=adapter_dirs(root, oracles))
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
    with pytest.raises(LoraError, match="another base"):
        engine.load_lora("other", str(other))
    assert "other" not in engine.lora_names()
    check_mixed_batch(engine, oracles, f"{arch} tp_size=2 after a refusal")


def test_tp2_unload_then_reload_on_every_rank(tp2: tuple) -> None:
    """Unloading clears the slot on every rank and forgets the name; loading it again writes
    every rank's shard afresh, and the mixed batch still matches PEFT."""
    arch, engine, oracles, root = tp2
    engine.unload_lora("a2")
    assert "a2" not in engine.lora_names()
    with pytest.raises(LoraError, match="unknown LoRA adapter"):
        engine.add_request([5, 6], GREEDY, lora_name="a2")
    engine.load_lora("a2", str(root / "a2"))
    check_mixed_batch(engine, oracles, f"{arch} tp_size=2 after unload and reload")
