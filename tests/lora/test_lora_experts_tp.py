"""LoRA on the routed experts at tp_size 2 on Ray (CPU, gloo, real actors): each rank holds
its shard of every expert adapter (gate_up's B rows per gate/up half, down's A columns, as the
base experts split their intermediate size), and one batch mixing three experts-only adapters
with the bare base equals transformers + PEFT row by row, for LFM2-MoE and ZAYA1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")

from lora_adapters import EXPERT_PARAMS  # noqa: E402
from lora_runs import adapter_dirs, check_mixed_batch, make_oracles  # noqa: E402
from ray_env import private_ray  # noqa: E402

from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.execution.worker_spec import plan_worker_spec  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from workers.ray_executor import RayExecutor  # noqa: E402

pytestmark = pytest.mark.timeout(900)

# One KV head per rank (test_lora_tp.py's shape).
OVERRIDES = {"num_attention_heads": 8, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[None]:
    with private_ray("sclorax-", num_cpus=2):
        yield


@pytest.mark.parametrize("arch", ["lfm2_moe", "zaya1"])
def test_tp2_expert_adapters_match_peft(
    arch: str, ray_runtime: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
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
