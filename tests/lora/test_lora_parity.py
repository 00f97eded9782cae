"""Multi-LoRA greedy parity with transformers + PEFT (fp32, CPU): each adapter alone, and one
batch mixing three adapters with the bare base, every row against its own PEFT oracle."""

from __future__ import annotations

import pytest
from lora_adapters import make_adapter
from oracle import assert_matches_oracle, oracle_greedy

from shortconv import LLM, SamplingParams
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import RequestOutput
from shortconv.tiny.checkpoint import build_hf_model, make_tiny_checkpoint

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5, 9, 13, 20, 33, 7, 2], [7, 8, 40, 41, 42], [100, 3, 17], [11] * 21]
ARCHS = ["lfm2", "lfm2_moe", "lfm3", "zaya1"]


def run_all(engine: LLMEngine, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Queue every (prompt, adapter) at once and step them together to the end."""
    ids = [engine.add_request(p, GREEDY, lora_name=name) for p, name in jobs]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return [done[i].token_ids for i in ids]


@pytest.fixture(scope="module", params=ARCHS)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    ckpt = make_tiny_checkpoint(arch, root / "base", seed=0)
    oracles = {f"a{i}": make_adapter(arch, root / f"a{i}", seed=i) for i in range(3)}
    oracles["rs"] = make_adapter(arch, root / "rs", seed=7, rank=8, use_rslora=True)
    oracles[None] = build_hf_model(arch, seed=0).eval()
    modules = {name: str(root / name) for name in oracles if name is not None}
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
    """Each row equals its own adapter's oracle; the adapters really differ (so a row served
    by the wrong adapter, or by none, is caught)."""
    arch, llm, oracles = setup
    names = ["a0", None, "a1", "a2"]
    ours = run_all(llm.engine, list(zip(PROMPTS, names, strict=True)))
    refs = [oracle_greedy(oracles[n], p, MAX_NEW) for p, n in zip(PROMPTS, names, strict=True)]
    for got, ref, name in zip(ours, refs, names, strict=True):
        assert_matches_oracle(got, ref, f"{arch} row with adapter {name}")
    crossed = [oracle_greedy(oracles[n], PROMPTS[0], MAX_NEW).tokens for n in ("a0", "a1", None)]
    assert len({tuple(t) for t in crossed}) == 3, "the adapters must change the tokens"
