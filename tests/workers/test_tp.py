"""Tensor parallelism on Ray (CPU, gloo): TP=2 and TP=4 decode exactly what TP=1 decodes.

One Ray runtime for the module; per architecture one TP=1 LocalExecutor and one RayExecutor
per TP size (started on first use), shared by several engines (chunked prefill, joins mid-run,
sessions) whose pools have the same capacity: a fresh request never reads state it did not
write, so reuse is safe. LFM2 and ZAYA1 have 8 query / 2 KV heads, so TP=2 gives each rank one
KV head (ZAYA1: rank 0 the current-token head, rank 1 the previous-token head) and TP=4
replicates each KV head on two ranks. LFM3 has 8 query / 4 KV heads (as the released 16 / 4):
TP=2 and TP=4 both split the KV heads; its sliding layers' window (8) is one KV page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from oracle import NEAR_TIE  # noqa: E402
from ray_env import private_ray  # noqa: E402

from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.configs.hf.availability import transformers_lacks  # noqa: E402
from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.engine.outputs import RequestOutput  # noqa: E402
from shortconv.engine.plan import StepPlan, StepResult  # noqa: E402
from shortconv.execution.local_executor import LocalExecutor  # noqa: E402
from shortconv.execution.worker_spec import WorkerSpec, plan_worker_spec  # noqa: E402
from shortconv.kernels import cpu_gemm as cg  # noqa: E402
from shortconv.kernels.cpu_gemm_q4 import q4_int8_activations  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from workers.cpu_threads import threads_for  # noqa: E402
from workers.ray_executor import RayExecutor  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 9, 13], [7, 8, 40, 41, 42, 43, 44, 45, 46, 47, 48], [100, 3, 77, 250, 19, 2], [11]]
# 8 query / 2 KV heads: one KV head per rank at TP=2, each replicated on two ranks at TP=4.
OVERRIDES = {
    "lfm2": {"num_attention_heads": 8, "num_key_value_heads": 2},
    "zaya1": {"num_attention_heads": 8, "num_key_value_heads": 2},
}
TP_SIZES = {"lfm2": (2, 4), "lfm2_moe": (2,), "lfm3": (2, 4), "zaya1": (2, 4)}
WORKER_CPUS = 0.25  # a TP=2 and a TP=4 group of one arch fit the runtime's 2 CPUs together


def engine_config(max_num_batched_tokens: int = 512) -> EngineConfig:
    # Fixed pool sizes: every engine of a module shares one executor, so capacity must agree.
    return EngineConfig(
        max_num_seqs=4,
        num_state_slots=9,
        num_checkpoint_slots=7,
        num_kv_pages=32,
        kv_page_size=8,
        max_num_batched_tokens=max_num_batched_tokens,
    )


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[None]:
    with private_ray("sctp-", num_cpus=2):
        yield


@dataclass
class Group:
    """One architecture's checkpoint, its TP=1 executor and its TP>1 executors."""

    arch: str
    ckpt: Path
    tp1: LocalExecutor
    spec: WorkerSpec
    executors: dict[int, RayExecutor] = field(default_factory=dict)

    def executor(self, tp: int) -> LocalExecutor | RayExecutor:
        if tp == 1:
            return self.tp1
        if tp not in TP_SIZES[self.arch]:
            pytest.skip(f"{self.arch} is checked at tp_size {TP_SIZES[self.arch]}")
        if tp not in self.executors:
            self.executors[tp] = RayExecutor(self.spec, tp, num_cpus_per_worker=WORKER_CPUS)
        return self.executors[tp]

    def engine(self, tp: int, max_num_batched_tokens: int = 512) -> LLMEngine:
        ex = self.executor(tp)
        eng = engine_config(max_num_batched_tokens)
        return LLMEngine(replace(self.spec, engine_cfg=eng), ex)


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe", "lfm3", "zaya1"])
def group(request, ray_runtime, tmp_path_factory):
    arch = request.param
    model_type = {"zaya1": "zaya", "lfm3": "lfm3"}.get(arch)
    if model_type and (reason := transformers_lacks(model_type)):
        pytest.skip(reason)  # the one documented skip: no transformers to write the checkpoint
    ckpt = make_tiny_checkpoint(
        arch, tmp_path_factory.mktemp(arch), OVERRIDES.get(arch), seed=7, with_tokenizer=False
    )
    spec = plan_worker_spec(ckpt, engine_config(), "float32")
    g = Group(arch, ckpt, LocalExecutor(spec), spec)
    yield g
    for ex in g.executors.values():
        ex.shutdown()
    g.tp1.shutdown()


def drive(engine: LLMEngine, schedule: dict[int, list[list[int]]]) -> dict[str, RequestOutput]:
    """Step `engine`, adding schedule[k] before step k; run until every request finishes."""
    done: dict[str, RequestOutput] = {}
    step, last = 0, max(schedule, default=-1)
    while step <= last or engine.has_unfinished():
        for i, prompt in enumerate(schedule.get(step, [])):
            engine.add_request(prompt, GREEDY, request_id=f"step{step}-{i}")
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out
        step += 1
    return done


def assert_same_greedy(got: RequestOutput, tp1: RequestOutput, tol: float = 1e-4) -> None:
    """Token for token, except past a near-tie of TP=1 (summation order differs under TP)."""
    assert len(got.token_ids) == len(tp1.token_ids)
    for i, (a, b) in enumerate(zip(got.token_ids, tp1.token_ids, strict=True)):
        top = tp1.top_logprobs[i]
        if a != b:
            margin = top[0][1] - top[1][1]
            assert margin < NEAR_TIE, f"{tp1.request_id}: token {i}: tp>1 {a} != tp1 {b}"
            return
        assert got.logprobs[i] == pytest.approx(tp1.logprobs[i], abs=tol)


def compare(
    group: Group, tp: int, schedule: dict[int, list[list[int]]], budget: int = 512
) -> list[StepPlan]:
    """Run `schedule` at TP=1 and at `tp`; returns the TP>1 plans for further checks."""
    engine = group.engine(tp, budget)  # first: skips a TP size the arch is not checked at
    ref = drive(group.engine(1, budget), schedule)
    plans: list[StepPlan] = []
    inner = engine.executor.execute
    engine.executor = _Recording(inner, plans)  # type: ignore[assignment]
    got = drive(engine, schedule)
    assert sorted(got) == sorted(ref)
    for rid in ref:
        assert_same_greedy(got[rid], ref[rid])
    return plans


class _Recording:
    """Executor stand-in that records every plan it forwards."""

    def __init__(self, execute: Callable[[StepPlan], StepResult], plans: list[StepPlan]) -> None:
        self._execute, self.plans = execute, plans

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        return self._execute(plan)


TP = pytest.mark.parametrize("tp", [2, 4])


@TP
def test_tp_greedy_equals_tp1(group: Group, tp: int) -> None:
    compare(group, tp, {0: PROMPTS})


@TP
def test_tp_chunked_prefill_equals_tp1(group: Group, tp: int) -> None:
    plans = compare(group, tp, {0: PROMPTS[:3]}, budget=4)
    assert max(p.num_tokens for p in plans) <= 4
    # A chunk that resumes a prompt mid-way (state carried over on every rank) did happen.
    assert any(s.start_pos > 0 and s.sampling is None for p in plans for s in p.seqs)


@TP
def test_tp_requests_joining_mid_run_equal_tp1(group: Group, tp: int) -> None:
    plans = compare(group, tp, {0: PROMPTS[:2], 3: [PROMPTS[2]], 5: [PROMPTS[3], [1, 2, 3, 4, 5]]})
    # Newcomers were prefilled in the same steps as running requests' decodes.
    assert any(
        any(s.start_pos == 0 for s in p.seqs) and any(s.start_pos > 0 for s in p.seqs if s.sampling)
        for p in plans
    )


@TP
def test_tp_session_resume_equals_tp1(group: Group, tp: int) -> None:
    """Kept session state (slot copies in the plan) is copied on every rank alike."""
    group.executor(tp)  # skips a TP size the arch is not checked at
    outs = []
    for size in (1, tp):
        engine, turns = group.engine(size), []
        prompt = [5, 9, 13, 17, 21]
        for _ in range(2):
            rid = engine.add_request(prompt, GREEDY, session_id=f"s{tp}")
            out = drive(engine, {})[rid]
            turns.append(out)
            prompt = prompt + out.token_ids + [60, 61]
        assert turns[1].num_cached_tokens > 0
        outs.append(turns)
    for a, b in zip(outs[1], outs[0], strict=True):
        assert_same_greedy(a, b)


@TP
def test_tp_forks_equal_tp1(group: Group, tp: int) -> None:
    """n = 3 from one prefill: the parent's last chunk samples one row per fork on rank 0, and
    every rank copies the parent's state for each fork alike (one fork, plus a plain request
    to share the steps). Greedy forks equal the plain request's tokens at TP=1."""
    group.executor(tp)  # skips a TP size the arch is not checked at
    forked = replace(GREEDY, n=3)
    outs: dict[int, dict[str, RequestOutput]] = {}
    for size in (1, tp):
        engine, done = group.engine(size), {}
        engine.add_request(PROMPTS[1], forked, request_id="fork")
        engine.add_request(PROMPTS[2], GREEDY, request_id="plain")
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    done[f"{out.request_id}/{out.index}"] = out
        engine.flush_prefix_cache()
        assert (engine.stats().slots_used, engine.stats().kv_pages_used) == (0, 0)
        outs[size] = done
    solo = drive(group.engine(1), {0: [PROMPTS[1]]})["step0-0"]
    assert sorted(outs[tp]) == sorted(outs[1]) == ["fork/0", "fork/1", "fork/2", "plain/0"]
    for key, ref in outs[1].items():
        assert_same_greedy(outs[tp][key], ref)
        if key.startswith("fork"):
            assert ref.token_ids == solo.token_ids


# Hand-computed per-rank state shapes of the tiny checkpoints (engine_config: 9 + 7 slots,
# 32 pages of 8 tokens). LFM2: 64 channels, head_dim 8, 4 conv and 2 attention layers of 6.
# LFM2-MoE: 4 query / 2 KV heads (head_dim 16), 2 conv and 2 attention layers.
# ZAYA1: head_dim 16, 3 layers; conv channels (own query heads + KV heads) * 16; the
# previous-token width is the rank's share of the 2 * 16 / 2 = 16 previous-token channels,
# all on the rank(s) holding KV head 1. LFM3: 64 channels, width 7, 3 conv and 3 attention
# layers of 6, 4 KV heads of 16; KV in two groups (docs/kv_memory.md): the full layer's 32
# pages, and the 2 sliding layers' (window 8: 2 pages a row) 1 + 4 rows * (2 + 1) + 512 / 8
# (a step's chunks) + (9 - 1 - 4) spare slots * 2 = 85 pages of 8.
EXPECTED_STATES = {
    ("lfm3", 2): [{"conv": (3, 16, 32, 6), "kv": (1, 256, 2, 16), "kv1": (2, 680, 2, 16)}] * 2,
    ("lfm3", 4): [{"conv": (3, 16, 16, 6), "kv": (1, 256, 1, 16), "kv1": (2, 680, 1, 16)}] * 4,
    ("lfm2", 2): [{"conv": (4, 16, 32, 2), "kv": (2, 256, 1, 8)}] * 2,
    ("lfm2", 4): [{"conv": (4, 16, 16, 2), "kv": (2, 256, 1, 8)}] * 4,
    ("lfm2_moe", 2): [{"conv": (2, 16, 32, 2), "kv": (2, 256, 1, 16)}] * 2,
    ("zaya1", 2): [
        {"conv": (3, 16, 80, 2), "prev_state": (3, 16, 0), "kv": (3, 256, 1, 16)},
        {"conv": (3, 16, 80, 2), "prev_state": (3, 16, 16), "kv": (3, 256, 1, 16)},
    ],
    ("zaya1", 4): [{"conv": (3, 16, 48, 2), "prev_state": (3, 16, 0), "kv": (3, 256, 1, 16)}] * 2
    + [{"conv": (3, 16, 48, 2), "prev_state": (3, 16, 16), "kv": (3, 256, 1, 16)}] * 2,
}


@TP
def test_each_rank_holds_only_its_heads(group: Group, tp: int) -> None:
    ranks = group.executor(tp).state_shapes()
    assert ranks == EXPECTED_STATES[(group.arch, tp)]
    full_params = {n: tuple(p.shape) for n, p in group.tp1.runner.model.named_parameters()}
    full = sum(torch.Size(s).numel() for s in full_params.values())
    for rank_params in group.executor(tp).call_workers("param_shapes"):
        assert set(rank_params) == set(full_params)
        for n, shape in rank_params.items():
            assert len(shape) == len(full_params[n]), n
            assert all(a <= b for a, b in zip(shape, full_params[n], strict=True)), n
        # The big matrices are split; only small vectors (norms, router) and the KV heads a
        # rank's query heads need stay whole.
        assert sum(torch.Size(s).numel() for s in rank_params.values()) < 0.6 * full


@TP
def test_each_rank_computes_on_its_reserved_cpus(group: Group, tp: int) -> None:
    """A rank's torch threads are its bundle's CPUs (Ray's OMP_NUM_THREADS aside)."""
    assert group.executor(tp).call_workers("torch_threads") == [threads_for(WORKER_CPUS)] * tp


@TP
def test_each_rank_reports_its_start(group: Group, tp: int) -> None:
    reports = group.executor(tp).startup_reports()
    assert [r.who.split(" (")[0] for r in reports] == [f"TP rank {r}" for r in range(tp)]
    for r in reports:
        # The CPU kernels load before the model is built: its linear methods are bound then.
        assert [name for name, _ in r.phases][:3] == ["join", "cpu_kernels", "weights"]
        assert "state_pool" in dict(r.phases) and r.rss_bytes > 50 * 2**20
        assert "RSS" in r.line()


@TP
def test_slot_ids_identical_across_ranks(group: Group, tp: int) -> None:
    """Slots come from the plan: every rank resolves the same cache_indices, step by step."""
    engine = group.engine(tp)
    plans: list[StepPlan] = []
    engine.executor = _Recording(engine.executor.execute, plans)  # type: ignore[assignment]
    for prompt in PROMPTS:
        engine.add_request(prompt, GREEDY)
    slots_seen: set[int] = set()
    while engine.has_unfinished():
        engine.step()
        resolved = group.executor(tp).call_workers("last_cache_indices")
        assert resolved == [[s.slot for s in plans[-1].seqs]] * tp
        slots_seen.update(resolved[0])
    assert len(slots_seen) == len(PROMPTS)


def test_tp_prefix_cache_hits_equal_uncached_tp1(group: Group) -> None:
    """Prefix-cache hits at TP=2 (state checkpoints inside and at the end of chunks, slot and
    page copies on every rank) decode what TP=1 decodes without the cache."""
    shared = [(13 * i + 5) % 200 + 3 for i in range(20)]
    schedule = {
        0: [shared + [1]],
        12: [shared + [2, 3], shared + [4]],  # resume at 16 (checkpoints every 8 tokens)
        24: [shared[:13] + [9]],  # at 8
    }
    cfg = replace(engine_config(6), prefix_checkpoint_interval=8)  # chunks of 6: inside too
    ex = group.executor(2)
    ref = drive(
        LLMEngine(
            replace(group.spec, engine_cfg=replace(cfg, enable_prefix_caching=False)), group.tp1
        ),
        schedule,
    )
    engine = LLMEngine(replace(group.spec, engine_cfg=cfg), ex)
    plans: list[StepPlan] = []
    engine.executor = _Recording(ex.execute, plans)  # type: ignore[assignment]
    got = drive(engine, schedule)
    cached = {rid: out.num_cached_tokens for rid, out in got.items()}
    assert cached == {"step0-0": 0, "step12-0": 16, "step12-1": 16, "step24-0": 8}
    assert any(p.copies_before for p in plans) and any(s.checkpoints for p in plans for s in p.seqs)
    for rid in ref:
        assert_same_greedy(got[rid], ref[rid])
    engine.flush_prefix_cache()
    assert engine.stats().slots_used == 0 and engine.stats().kv_pages_used == 0


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tp_quantized_equals_tp1_quantized(group: Group, method: str) -> None:
    """quantization="int8"/"int4" at TP 2: each rank quantizes its own shard in blocks of 32
    that never straddle two ranks, so the ranks hold TP 1's integers and scales (and q4's mins)
    split, and decode TP 1's quantized tokens. Logprobs agree to 1e-3 rather than fp32's 1e-4
    (int8 measured 1.6e-4): TP's own fp32 summation-order differences in the activations move
    an occasional value across an int16 rounding boundary (1/32767 of its block's largest
    magnitude). int4 on a VNNI CPU rounds activations to int8 (1/127 of the block's largest
    magnitude, 258x coarser): there crossings moved a logprob by 0.021 and 0.064 in two runs
    (LFM2, on the Xeon), so its bound is 0.15, and the test's weight is on the tokens, which
    must still be TP 1's (a per-row min, which straddles the ranks, fails that at token 0)."""
    if group.arch != "lfm2":
        pytest.skip("checked on LFM2: quantization is per layer kind, not per architecture")
    coarse = method == "int4" and cg.load() is None and q4_int8_activations()
    spec = replace(group.spec, engine_cfg=replace(engine_config(), quantization=method))
    tp1, tp2 = LocalExecutor(spec), RayExecutor(spec, 2, num_cpus_per_worker=WORKER_CPUS)
    try:
        ref = drive(LLMEngine(spec, tp1), {0: PROMPTS})
        got = drive(LLMEngine(spec, tp2), {0: PROMPTS})
        assert sorted(got) == sorted(ref)
        for rid in ref:
            assert_same_greedy(got[rid], ref[rid], tol=0.15 if coarse else 1e-3)
        assert method in tp1.runner.weight_bytes and method in tp2.weight_bytes()
        # The vocab-parallel LM head (q8 under int8, q6 under int4): each rank quantizes whole
        # rows.
        head = {"int8": "int8", "int4": "int6"}[method]
        assert head in tp1.runner.weight_bytes and head in tp2.weight_bytes()
    finally:
        tp2.shutdown()
        tp1.shutdown()
