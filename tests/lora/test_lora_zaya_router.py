"""LoRA on ZAYA1's router linears (the router's down_proj and its MLP's fc1, fc2, out_proj):
greedy parity with transformers + PEFT, each adapter alone and one batch mixing three
router-only adapters with the bare base. An adapter here changes which expert a token goes
to, so a row served by another row's adapter is routed differently."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lora_adapters import make_adapter
from lora_runs import MAX_NEW, PROMPTS, adapter_dirs, check_mixed_batch, make_oracles, run_all
from oracle import assert_matches_oracle, oracle_greedy

from shortconv import LLM
from shortconv.lora.install import lora_layers
from shortconv.tiny.checkpoint import make_tiny_checkpoint

ROUTER = ["gate.down_proj", "router_mlp.fc1", "router_mlp.fc2", "router_mlp.out_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    root = tmp_path_factory.mktemp("lora-zaya-router")
    ckpt = make_tiny_checkpoint("zaya1", root / "base", seed=0)
    oracles = make_oracles("zaya1", root, targets=ROUTER)
    oracles["rs"] = make_adapter(
        "zaya1", root / "rs", seed=7, rank=8, targets=ROUTER, use_rslora=True
    )
    llm = LLM(
        ckpt,
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        lora_modules=adapter_dirs(root, oracles),
    )
    yield llm, oracles
    llm.shutdown()


def test_every_router_linear_is_adapted(setup: tuple) -> None:
    llm, _ = setup
    model = llm.engine.executor.runner.model
    slot = llm.engine.loras.slots.slot_of("a0")
    adapted = {n for n, m in lora_layers(model).items() if m.lora.ranks[slot]}
    router = {n for n in adapted if ".mlp.gate." in n}
    assert router == adapted, "a router-only adapter adapts the router's linears alone"
    leaves = {n.removeprefix(n.split(".mlp.gate.")[0] + ".mlp.gate.") for n in router}
    assert leaves == {"down_proj", "router_mlp.fc1", "router_mlp.fc2", "router_mlp.out_proj"}


def test_each_adapter_alone_matches_peft(setup: tuple) -> None:
    llm, oracles = setup
    for name in ("a0", "rs"):
        ours = run_all(llm.engine, [(PROMPTS[0], name)])[0]
        ref = oracle_greedy(oracles[name], PROMPTS[0], MAX_NEW)
        assert_matches_oracle(ours, ref, f"zaya1 router adapter {name}")


def test_a_batch_mixing_three_router_adapters_and_the_base(setup: tuple) -> None:
    llm, oracles = setup
    check_mixed_batch(llm.engine, oracles, "zaya1 router")
