"""ZAYA1 greedy parity with transformers' ZayaForCausalLM (fp32, CPU): batched prompts of
lengths 1..64 under small chunked prefill, requests joining mid-run, the skip route, resumed
state at the runner level.

The oracle is the in-memory model from build_hf_model (its `generate`, with the cache, one
prompt at a time): a reloaded one would have its skip bias reset by transformers 5.24's
`_init_weights` (see shortconv/tiny/checkpoint.py).
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from oracle import OracleRun, assert_matches_oracle
from transformers import GenerationConfig

from shortconv import LLM, SamplingParams
from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.engine.outputs import RequestOutput
from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.execution.local_executor import LocalExecutor
from shortconv.execution.worker_spec import Capacity, WorkerSpec
from shortconv.layers.zaya_moe import ZayaRouter
from shortconv.llm import build_engine
from shortconv.sampling.sampler import SamplingRow
from shortconv.tiny.checkpoint import build_hf_model

CONFIGS: dict[str, dict] = {
    "base": {},
    # MHA-ish GQA (3 KV heads), t0=3/t1=1, q/k/v/o and lm_head biases, 3 experts, gelu experts.
    "bias-t31": {
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 8,
        "cca_time0": 3,
        "cca_time1": 1,
        "num_experts": 3,
        "attention_bias": True,
        "lm_head_bias": True,
        "hidden_act": "gelu",
    },
    # MQA (1 KV head: value head = [current half ‖ previous half]), t0=1/t1=3, untied head.
    "mqa-t13": {
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 12,
        "cca_time0": 1,
        "cca_time1": 3,
        "num_experts": 6,
        "tie_word_embeddings": False,
        "router_hidden_size": 16,
        "rope_parameters": {
            "hybrid": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        },
    },
    # Deeper, t0=t1=3, and a raised skip-class bias so the skip route is really taken.
    "skip-t33": {
        "num_hidden_layers": 4,
        "cca_time0": 3,
        "cca_time1": 3,
        "num_experts": 4,
        "attention_bias": True,
        "skip_bias": 0.05,
    },
}
LENGTHS = [1, 2, 3, 4, 7, 12, 20, 33, 47, 64]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
LOGPROB_TOL = 1e-4


def oracle_generate(
    hf: torch.nn.Module, prompt: list[int], max_new: int
) -> tuple[OracleRun, list[float]]:
    """transformers' greedy `generate` (cached decode): its tokens, the top-2 margins of its own
    logits, and the log-probability of each chosen token."""
    gc = GenerationConfig(
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), generation_config=gc)
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == max_new, "oracle stopped early"
    margins, logprobs = [], []
    for tok, logits in zip(tokens, out.logits, strict=True):
        top2 = torch.topk(logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
        logprobs.append(float(torch.log_softmax(logits[0].float(), -1)[tok]))
    return OracleRun(tokens, margins), logprobs


class Case:
    """One tiny config: in-memory oracle, its checkpoint, prompts and cached oracle runs."""

    def __init__(self, name: str, tmp_dir) -> None:
        self.name = name
        self.hf = build_hf_model("zaya1", dict(CONFIGS[name]), seed=11)
        self.hf.save_pretrained(str(tmp_dir))
        # EOS is just another token for the oracle, like ignore_eos=True for the engine.
        self.hf.generation_config.eos_token_id = None
        self.path = tmp_dir
        self.cfg = ModelConfig.from_dir(tmp_dir)
        rng = random.Random(zlib.crc32(name.encode()))
        self.prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]
        self._oracle: dict[tuple[int, ...], tuple[OracleRun, list[float]]] = {}

    def oracle(self, prompt: list[int], max_new: int = MAX_NEW) -> OracleRun:
        return self._run(prompt, max_new)[0]

    def _run(self, prompt: list[int], max_new: int) -> tuple[OracleRun, list[float]]:
        key = (*prompt, -max_new)
        if key not in self._oracle:
            self._oracle[key] = oracle_generate(self.hf, prompt, max_new)
        return self._oracle[key]

    def check(self, prompt: list[int], out: RequestOutput, what: str) -> None:
        """Tokens as the oracle's (near-tie rule); logprobs too, up to a divergence."""
        ref, logprobs = self._run(prompt, len(out.token_ids))
        assert_matches_oracle(out.token_ids, ref, f"{self.name} {what}")
        for i, (a, b) in enumerate(zip(out.token_ids, ref.tokens, strict=True)):
            if a != b:
                break
            assert abs(out.logprobs[i] - logprobs[i]) < LOGPROB_TOL, f"{what}: logprob {i}"


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def test_nothing_left_at_default_init(case: Case) -> None:
    """Re-randomisation leaves no norm weight, scale, bias or temp at its 0/1 default."""
    tensors = dict(case.hf.named_parameters()) | {
        n: b for n, b in case.hf.named_buffers() if "rotary_emb" not in n
    }
    for name, t in tensors.items():
        if t.dim() == 1:
            body = t[:-1] if name.endswith("balancing_biases") else t
            assert not bool((body == 0).all()), f"{name} left at 0"
            assert not bool((body == 1).all()), f"{name} left at 1"
    temps = [t for n, t in tensors.items() if n.endswith("qk_norm.temp")]
    assert temps and all(float(t.detach().abs().min()) > 0.3 for t in temps)


def test_batched_chunked_prefill_matches_oracle(case: Case) -> None:
    llm = LLM(case.path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=16)
    outs = llm.generate(prompt_token_ids=case.prompts, sampling_params=GREEDY)
    for prompt, out in zip(case.prompts, outs, strict=True):
        case.check(prompt, out, f"len={len(prompt)}")


def test_requests_joining_mid_run(case: Case) -> None:
    eng = build_engine(
        case.path,
        dtype="float32",
        engine_config=EngineConfig(max_num_batched_tokens=12, max_num_seqs=8),
    )
    first, later = case.prompts[::2], case.prompts[1::2]
    ids = {eng.add_request(p, GREEDY): p for p in first}
    got: dict[str, RequestOutput] = {}
    for _ in range(4):
        got |= {out.request_id: out for out in eng.step()}
    assert got and len(got) < len(first) + len(later)  # some finished work before the joins
    ids |= {eng.add_request(p, GREEDY): p for p in later}
    while eng.has_unfinished():
        got |= {out.request_id: out for out in eng.step()}
    for rid, prompt in ids.items():
        case.check(prompt, got[rid], rid)


@pytest.mark.parametrize("case", ["skip-t33"], indirect=True)
def test_skip_route_taken_and_checkpoint_bias_honoured(case: Case) -> None:
    prompts = case.prompts[-3:]
    hf_skips, our_skips = [], []

    def hf_hook(mod, _args, out) -> None:
        biased = torch.softmax(out[0].float(), -1) + mod.balancing_biases
        hf_skips.append(int((biased.argmax(-1) == mod.num_experts).sum()))

    hooks = [
        m.register_forward_hook(hf_hook)
        for m in case.hf.modules()
        if type(m).__name__ == "ZayaRouter"
    ]
    with torch.inference_mode():
        for p in prompts:
            case.hf(torch.tensor([p]))
    for h in hooks:
        h.remove()
    assert sum(hf_skips) > 0, "the oracle never took the skip route"

    llm = LLM(case.path, dtype="float32", max_num_batched_tokens=32)
    model = llm.engine.executor.runner.model
    routers = [m for m in model.modules() if isinstance(m, ZayaRouter)]
    assert all(float(r.balancing_biases[-1]) == pytest.approx(0.05) for r in routers)
    hooks = [
        r.register_forward_hook(
            lambda mod, _a, out: our_skips.append(int((out[1] == mod.num_experts).sum()))
        )
        for r in routers
    ]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for h in hooks:
        h.remove()
    assert sum(our_skips) > 0, "the engine never took the skip route"
    for prompt, out in zip(prompts, outs, strict=True):
        case.check(prompt, out, f"len={len(prompt)}")


# ---- resume at the runner level -------------------------------------------------------------
PAGE = 4
ROW = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)


def _pages(first: int, n_pos: int) -> tuple[int, ...]:
    return tuple(range(first, first + -(-n_pos // PAGE)))


def _run(runner, seqs: list[SeqChunk]) -> torch.Tensor:
    """Logits [sampled rows, V] of one hand-built step."""
    plan = StepPlan(step_id=0, seqs=tuple(seqs))
    with torch.inference_mode():
        step = runner.backend.begin_step(plan)
        hidden = runner.model(step.input_ids, runner.backend)
        return runner.model.compute_logits(hidden[step.logits_indices])


def _decode(runner, rid: str, slot: int, page0: int, tokens: list[int], n: int):
    """Greedy-decode n tokens for a slot whose state covers tokens[:-1] (last not yet fed)."""
    toks, logits = list(tokens), []
    for _ in range(n):
        pos = len(toks) - 1
        out = _run(runner, [SeqChunk(rid, (toks[-1],), pos, slot, _pages(page0, pos + 1), ROW)])
        logits.append(out[0])
        toks.append(int(out[0].argmax()))
    return toks[len(tokens) :], logits


@pytest.mark.parametrize("case", ["base"], indirect=True)
def test_resume_from_retained_state_equals_full_recompute(case: Case) -> None:
    eng = EngineConfig(max_num_seqs=8, kv_page_size=PAGE, num_kv_pages=80, num_state_slots=10)
    spec = WorkerSpec(
        case.path, case.cfg, eng, Capacity(10, 80), torch.float32, torch.device("cpu"), 64
    )
    runner = LocalExecutor(spec).runner
    rng = random.Random(3)
    p1 = [rng.randrange(3, 512) for _ in range(11)]
    other = [rng.randrange(3, 512) for _ in range(9)]
    extra = [rng.randrange(3, 512) for _ in range(10)]
    # Turn 1 in slot 3 (pages 1..), prefilled in two chunks next to another fresh request.
    _run(
        runner,
        [
            SeqChunk("a", tuple(p1[:7]), 0, 3, _pages(1, 7), None),
            SeqChunk("o", tuple(other), 0, 6, _pages(40, 9), ROW),
        ],
    )
    first = _run(runner, [SeqChunk("a", tuple(p1[7:]), 7, 3, _pages(1, 11), ROW)])
    gen1, _ = _decode(runner, "a", 3, 1, [*p1, int(first[0].argmax())], 4)
    gen1 = [int(first[0].argmax()), *gen1]
    assert_matches_oracle(gen1, case.oracle(p1, 5), "turn 1")

    # Turn 2 resumes slot 3: the unfed last token + new text, start_pos > 0, longer block
    # table, in one packed step with a fresh request (has_initial_state mixed).
    full = [*p1, *gen1, *extra]
    start = len(p1) + len(gen1) - 1
    resumed = _run(
        runner,
        [
            SeqChunk("o2", tuple(other[:5]), 0, 7, _pages(60, 5), ROW),
            SeqChunk("a", tuple(full[start:]), start, 3, _pages(1, len(full)), ROW),
        ],
    )[1]
    gen2, logits2 = _decode(runner, "a", 3, 1, [*full, int(resumed.argmax())], 4)

    fresh = _run(runner, [SeqChunk("b", tuple(full), 0, 5, _pages(20, len(full)), ROW)])[0]
    ref2, ref_logits2 = _decode(runner, "b", 5, 20, [*full, int(fresh.argmax())], 4)
    torch.testing.assert_close(resumed, fresh, rtol=1e-5, atol=1e-5)
    for a, b in zip(logits2, ref_logits2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert [int(resumed.argmax()), *gen2] == [int(fresh.argmax()), *ref2]
    assert_matches_oracle([int(resumed.argmax()), *gen2], case.oracle(full, 5), "turn 2")
