"""Kept state never crosses adapters (prefix cache, sessions), and an int8 base takes a float
adapter: its LoRA layer is exactly the q8 layer plus the float adapter product."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_adapters import make_adapter
from oracle import assert_matches_oracle, oracle_greedy

from shortconv import LLM, SamplingParams
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import RequestOutput
from shortconv.execution.parallel import SINGLE
from shortconv.kernels import cpu_gemm
from shortconv.layers.linear import ColumnParallelLinear
from shortconv.layers.quantize import Q8Linear
from shortconv.lora.batch import LoraBatch
from shortconv.lora.linear import LoRALinear
from shortconv.tiny.checkpoint import make_tiny_checkpoint

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPT = [(7 * i + 3) % 500 for i in range(70)]  # past one prefix checkpoint interval


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, dict]:
    root = tmp_path_factory.mktemp("lora-state")
    ckpt = make_tiny_checkpoint("lfm2", root / "base", seed=0)
    oracles = {n: make_adapter("lfm2", root / n, seed=i) for i, n in enumerate(("a", "b"))}
    modules = {n: str(root / n) for n in oracles}
    llm = LLM(ckpt, dtype="float32", enable_lora=True, lora_modules=modules)
    yield llm, oracles
    llm.shutdown()


def run(engine: LLMEngine, prompt: list[int], name: str | None, session: str | None = None):
    rid = engine.add_request(prompt, GREEDY, lora_name=name, session_id=session)
    out: RequestOutput | None = None
    while engine.has_unfinished():
        out = next((o for o in engine.step() if o.finished and o.request_id == rid), out)
    assert out is not None
    return out


def test_no_prefix_cache_hit_across_adapters(env: tuple[LLM, dict]) -> None:
    llm, oracles = env
    first = run(llm.engine, PROMPT, "a")
    assert run(llm.engine, PROMPT, "a").num_cached_tokens > 0  # the cache does hit
    other = run(llm.engine, PROMPT, "b")
    assert other.num_cached_tokens == 0
    assert run(llm.engine, PROMPT, None).num_cached_tokens == 0
    assert_matches_oracle(other.token_ids, oracle_greedy(oracles["b"], PROMPT, MAX_NEW), "b")
    assert_matches_oracle(first.token_ids, oracle_greedy(oracles["a"], PROMPT, MAX_NEW), "a")


def test_a_session_resumes_only_under_its_adapter(env: tuple[LLM, dict]) -> None:
    llm, oracles = env
    turn1 = run(llm.engine, PROMPT[:20], "a", session="s1")
    follow = PROMPT[:20] + turn1.token_ids + [9, 10]
    assert run(llm.engine, follow, "b", session="s1").num_cached_tokens == 0
    turn1 = run(llm.engine, PROMPT[:20], "a", session="s2")
    follow = PROMPT[:20] + turn1.token_ids + [9, 10]
    again = run(llm.engine, follow, "a", session="s2")
    # The kept state folds in every token but the last one drawn (never fed back).
    assert again.num_cached_tokens == 20 + MAX_NEW - 1
    assert_matches_oracle(again.token_ids, oracle_greedy(oracles["a"], follow, MAX_NEW), "s2")


def test_q8_base_with_a_float_adapter_is_exact_per_row() -> None:
    """Rows 0 and 3 take slot 0, row 2 slot 1 (a smaller rank in a zero-padded slot), row 1
    none: each is the q8 layer's own output plus its adapter's product, row 1 exactly q8's."""
    why = cpu_gemm.load()
    if why is not None:
        pytest.skip(why)
    gen = torch.Generator().manual_seed(0)
    layer = ColumnParallelLinear(64, 96, False, SINGLE).requires_grad_(False)
    layer.weight.copy_(torch.randn(96, 64, generator=gen))
    batch = LoraBatch(max_loras=2, max_rank=8, device=torch.device("cpu"))
    layer.method = LoRALinear(Q8Linear(), batch)
    layer.method.process_after_load(layer)
    assert layer.lora is not None and layer.q8 is not None
    adapters = [
        (torch.randn(r, 64, generator=gen), torch.randn(96, r, generator=gen)) for r in (8, 3)
    ]
    for slot, (a, b) in enumerate(adapters):
        layer.lora.a[slot, : a.shape[0]] = a
        layer.lora.b[slot, :, : a.shape[0]] = b
        layer.lora.ranks[slot] = a.shape[0]
    x = torch.randn(4, 64, generator=gen)
    base = Q8Linear().apply(layer, x, None)
    batch.set_rows([0, -1, 1, 0], x.device)
    got = layer(x)
    want = base.clone()
    for row, slot in ((0, 0), (2, 1), (3, 0)):
        a, b = adapters[slot]
        want[row] += (x[row] @ a.t()) @ b.t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[1], base[1])


def test_int8_base_serves_an_adapter(env: tuple[LLM, dict], tmp_path: Path) -> None:
    """Through the engine: the adapter changes the int8 base's tokens, and int8 + adapter
    stays near fp32 + adapter (most greedy tokens agree on this tiny random model)."""
    llm, _ = env
    ckpt = llm.engine.model_dir
    path = str(Path(llm.engine.loras.slots.get("a").adapter.path))  # type: ignore[union-attr]
    q8 = LLM(ckpt, dtype="float32", quantization="int8", enable_lora=True, lora_modules={"a": path})
    try:
        with_adapter = run(q8.engine, PROMPT[:12], "a").token_ids
        bare = run(q8.engine, PROMPT[:12], None).token_ids
    finally:
        q8.shutdown()
    fp32 = run(llm.engine, PROMPT[:12], "a").token_ids
    assert with_adapter != bare
    assert with_adapter[:2] == fp32[:2]


def test_an_evicted_adapter_is_written_back(env: tuple[LLM, dict]) -> None:
    """One slot for two adapters: each request evicts the other, and an adapter written back
    gives its own oracle's tokens again."""
    llm, oracles = env
    loras = llm.engine.loras
    assert loras is not None
    paths = {n: str(loras.slots.get(n).adapter.path) for n in ("a", "b")}
    one = LLM(
        llm.engine.model_dir, dtype="float32", enable_lora=True, max_loras=1, lora_modules=paths
    )
    try:
        got = [(n, run(one.engine, PROMPT[:9], n).token_ids) for n in ("a", "b", "a")]
    finally:
        one.shutdown()
    for name, tokens in got:
        assert_matches_oracle(tokens, oracle_greedy(oracles[name], PROMPT[:9], MAX_NEW), name)
