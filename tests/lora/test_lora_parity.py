"""Multi-LoRA greedy parity with transformers + PEFT (fp32, CPU): each adapter alone, and one
batch mixing three adapters with the bare base, every row against its own PEFT oracle."""

from __future__ import annotations

import pytest
from lora_adapters import make_adapter
from lora_runs import (
    MAX_NEW,
    PROMPTS,
    adapter_dirs,
    check_mixed_batch,
    make_oracles,
    run_all,
)
from oracle import assert_matches_oracle, oracle_greedy

from shortconv import LLM
from shortconv.tiny.checkpoint import make_tiny_checkpoint

ARCHS = ["lfm2", "lfm2_moe", "lfm3", "zaya1"]


@pytest.fixture(scope="module", params=ARCHS)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    ckpt = make_tiny_checkpoint(arch, root / "base", seed=0)
    oracles = make_oracles(arch, root)
    oracles["rs"] = make_adapter(arch, root / "rs", seed=7, rank=8, use_rslora=True)
    modules = adapter_dirs(root, oracles)
    llm = LLM(ckpt, dtype="float32", enable_lora=True, max_loras=4, lora_modules=modules)
    yield arch, llm, oracles
    llm.shutdown()


def test_each_adapter_alone_matches_peft(setup: tuple) -> None:
    arch, llm, oracles = setup
    for name in ("a0", "rs"):
        ours = run_all(llm.engine, [(PROMPTS[0], name)])[0]
        ref = oracle_greedy(oracles[name], PROMPTS[0], MAX_NEW)
        assert_matches_oracle(ours, ref, f"{arch} adapter {name}")


def test_a_batch_mixing_three_adapters_and_the_base(setup: tuple) -> None:
    arch, llm, oracles = setup
    check_mixed_batch(llm.engine, oracles, arch)
