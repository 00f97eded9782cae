"""LFM3 greedy parity with transformers' Lfm3ForCausalLM (fp32, CPU).

Tiny checkpoints with a window of a few KV pages (pages of 4 tokens here), so every case
below runs past the window: a single request; a mixed batch under chunked prefill whose chunks
cross window and page boundaries; prompts longer than three windows; decode far past the
window; a resumed session; a prefix-cache hit on a prefix longer than the window. Both attention
kinds (sliding and full, each with its RoPE), conv layers of width 7, the attention gates and
the sandwich norms are in every model; `plain` turns gates and sandwich norms off and biases on.

The oracle recomputes the whole sequence for every token (no cache), so transformers' own
sliding-window cache is not what we are compared with: its masks are.
"""

from __future__ import annotations

import random
import zlib

import pytest
from oracle import OracleRun, assert_matches_oracle, oracle_greedy
from triton_path import force_triton_path

from shortconv import LLM, SamplingParams
from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import RequestOutput
from shortconv.llm import build_engine
from shortconv.tiny.checkpoint import build_hf_model

pytestmark = pytest.mark.skipif(
    transformers_lacks("lfm3") is not None, reason=str(transformers_lacks("lfm3"))
)

PAGE = 4
CONFIGS: dict[str, dict] = {
    "base": {},  # window 8, conv width 7, gates and sandwich norms on, default RoPE per kind
    "plain": {
        "use_sandwich_norm": False,
        "use_attention_gate": False,
        "attention_bias": True,
        "conv_bias": True,
        "conv_L_cache": 3,
        "sliding_window": 6,  # not a multiple of the page size
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "num_hidden_layers": 7,
        "layer_types": None,  # Lfm3Config's pattern: conv, conv, full, conv, sliding, conv, full
        "rope_parameters": {
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": 5e5,
                "partial_rotary_factor": 0.25,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 3e3},
        },
    },
}
LENGTHS = [1, 3, 7, 8, 9, 17, 30, 41]  # around the window, and past three windows
MAX_NEW = 8


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


class Case:
    """One tiny config: the in-memory oracle, its checkpoint, prompts and cached oracle runs."""

    def __init__(self, name: str, tmp_dir) -> None:
        overrides = {k: v for k, v in CONFIGS[name].items()}
        self.name = name
        self.hf = build_hf_model("lfm3", overrides, seed=13)
        self.hf.save_pretrained(str(tmp_dir))
        self.path = tmp_dir
        self.cfg = ModelConfig.from_dir(tmp_dir)
        rng = random.Random(zlib.crc32(name.encode()))
        self.prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]
        self._runs: dict[tuple[int, ...], OracleRun] = {}

    def oracle(self, prompt: list[int], max_new: int = MAX_NEW) -> OracleRun:
        key = (*prompt, -max_new)
        if key not in self._runs:
            self._runs[key] = oracle_greedy(self.hf, prompt, max_new)
        return self._runs[key]

    def check(self, prompt: list[int], out: RequestOutput, what: str) -> None:
        ref = self.oracle(prompt, len(out.token_ids))
        assert_matches_oracle(out.token_ids, ref, f"{self.name} {what}")

    def engine(self, **kw: object) -> LLMEngine:
        cfg = EngineConfig(**{"kv_page_size": PAGE, **kw})  # type: ignore[arg-type]
        return build_engine(self.path, dtype="float32", engine_config=cfg)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def run_one(eng: LLMEngine, prompt: list[int], n: int, session: str | None = None):
    rid = eng.add_request(prompt, greedy(n), session_id=session)
    while True:
        for out in eng.step():
            assert out.error is None, out.error
            if out.request_id == rid and out.finished:
                return out


def test_model_has_what_issue_24_lists(case: Case) -> None:
    """Both attention kinds with a window spanning pages; nothing left at a 0/1 default."""
    cfg = case.cfg
    assert cfg.sliding_layer_ids and "attention" in cfg.layer_types
    assert sum(t == "conv" for t in cfg.layer_types) >= 2
    assert cfg.sliding_window > PAGE
    for name, t in case.hf.named_parameters():
        if t.dim() == 1:
            assert not bool((t == 0).all()) and not bool((t == 1).all()), name


def test_single_request(case: Case) -> None:
    prompt = case.prompts[5]
    case.check(prompt, run_one(case.engine(), prompt, MAX_NEW), "single")


@pytest.mark.parametrize("budget", [512, 7])
def test_mixed_batch(case: Case, budget: int) -> None:
    """Every length in one batch; budget 7 chunks the prompts (chunks of 7 cross the window and
    the 4-token pages at ever-shifting offsets) while the short ones already decode."""
    llm = LLM(case.path, dtype="float32", max_num_batched_tokens=budget, kv_page_size=PAGE)
    outs = llm.generate(prompt_token_ids=case.prompts, sampling_params=greedy())
    for prompt, out in zip(case.prompts, outs, strict=True):
        case.check(prompt, out, f"len={len(prompt)} budget={budget}")


def test_decode_far_past_the_window(case: Case) -> None:
    """A short prompt decoded for five windows: every sliding layer's keys leave the window."""
    prompt = case.prompts[2]
    n = 5 * case.cfg.sliding_window
    case.check(prompt, run_one(case.engine(), prompt, n), "long decode")


def test_requests_join_mid_run(case: Case) -> None:
    eng = case.engine(max_num_batched_tokens=10, max_num_seqs=8)
    ids, done, pending, steps = {}, {}, list(range(len(case.prompts))), 0
    while pending or eng.has_unfinished():
        if pending and steps % 2 == 0:  # joins land mid-prefill and mid-decode of the others
            i = pending.pop(0)
            ids[eng.add_request(case.prompts[i], greedy())] = i
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    assert len(done) == len(case.prompts)
    for rid, out in done.items():
        case.check(case.prompts[ids[rid]], out, f"joined len={len(case.prompts[ids[rid]])}")


def test_resumed_session(case: Case) -> None:
    """Turn 2 resumes turn 1's kept state (conv state and KV past the window), prefilling only
    the new suffix, in chunks."""
    eng = case.engine(max_num_batched_tokens=6, enable_prefix_caching=False)
    first = case.prompts[5]
    out1 = run_one(eng, first, MAX_NEW, session="s")
    second = first + out1.token_ids + [7, 8, 9, 10, 11]
    out2 = run_one(eng, second, MAX_NEW, session="s")
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens == len(first) + len(out1.token_ids) - 1
    case.check(first, out1, "turn 1")
    case.check(second, out2, "turn 2")


def test_prefix_cache_hit_longer_than_the_window(case: Case) -> None:
    """A second prompt shares a 33-token prefix (over four windows) with the first: it resumes
    from a checkpoint deeper than the window and decodes what the oracle decodes."""
    eng = case.engine(
        enable_prefix_caching=True, prefix_checkpoint_interval=2 * PAGE, max_num_batched_tokens=9
    )
    shared = case.prompts[-1][:33]
    a, b = shared + [5, 6, 7], shared + [9, 10, 11, 12]
    out_a = run_one(eng, a, MAX_NEW)
    out_b = run_one(eng, b, MAX_NEW)
    assert out_a.num_cached_tokens == 0
    assert out_b.num_cached_tokens == 32 > case.cfg.sliding_window
    case.check(a, out_a, "prefix owner")
    case.check(b, out_b, "prefix hit")


# ---- the GPU path (Triton kernels, interpreted) ----------------------------------------------
@pytest.mark.parametrize("case", ["base"], indirect=True)
def test_triton_path_past_the_window(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Width-7 conv and windowed paged attention on the Triton kernels, no SDPA: chunked
    prefill across window and page boundaries next to decodes, a long decode, and a
    prefix-cache hit deeper than the window. The oracle runs first (it needs SDPA)."""
    long_decode = 4 * case.cfg.sliding_window
    shared = case.prompts[-1][:33]
    batch = [case.prompts[i] for i in (0, 3, 5, 6)]
    refs = [case.oracle(p) for p in batch]
    ref_long = case.oracle(case.prompts[2], long_decode)
    pair = (shared + [5, 6, 7], shared + [9, 10, 11, 12])
    ref_pair = [case.oracle(p) for p in pair]
    pytest.importorskip("triton")
    triton_calls = force_triton_path(monkeypatch)
    eng = case.engine(max_num_batched_tokens=7, prefix_checkpoint_interval=2 * PAGE)
    ids = [eng.add_request(p, greedy()) for p in batch]
    done: dict[str, RequestOutput] = {}
    while eng.has_unfinished():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    for rid, prompt, ref in zip(ids, batch, refs, strict=True):
        assert_matches_oracle(done[rid].token_ids, ref, f"triton len={len(prompt)}")
    out = run_one(eng, case.prompts[2], long_decode)
    assert_matches_oracle(out.token_ids, ref_long, "triton long decode")
    outs = [run_one(eng, p, MAX_NEW) for p in pair]
    assert outs[1].num_cached_tokens == 32
    for o, ref in zip(outs, ref_pair, strict=True):
        assert_matches_oracle(o.token_ids, ref, "triton prefix hit")
    assert triton_calls["paged_attention_decode_triton"] > 0, triton_calls
    assert triton_calls["paged_attention_extend_triton"] > 0, triton_calls
