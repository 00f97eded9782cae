"""Tensor-parallel failure paths: refused before start-up, dead workers fail fast, restart works.

No shared runtime here on purpose: `LLM(tp_size=2)` must start (and stop) Ray by itself.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.configs.hf.availability import transformers_lacks  # noqa: E402
from shortconv.engine.executor import ExecutorError  # noqa: E402
from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.engine.plan import SeqChunk, StepPlan, StepResult  # noqa: E402
from shortconv.errors import CheckpointError, ConfigError  # noqa: E402
from shortconv.execution.worker_spec import plan_worker_spec  # noqa: E402
from shortconv.llm import LLM  # noqa: E402
from shortconv.sampling.sampler import SamplingRow  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from workers.ray_executor import RayExecutor  # noqa: E402
from workers.ray_runtime import acquire_runtime, release_runtime  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 13, 20], [7, 8]]
DETECT_WITHIN_S = 30.0
SMALL = {"max_num_seqs": 4, "num_kv_pages": 16, "kv_page_size": 8}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(
        "lfm2", tmp_path_factory.mktemp("lfm2"), seed=3, with_tokenizer=False
    )


def config_only(src: Path, dst: Path, **changes: object) -> Path:
    """A checkpoint dir with just a config.json: refusals must come before any weight is read."""
    raw = json.loads((src / "config.json").read_text())
    raw.update(changes)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


BAD_TP = [
    pytest.param({}, 3, "attention heads", id="heads"),
    pytest.param({}, 8, "attention heads", id="heads-above-tp"),
    # 3 KV heads at tp 2: rank 0's query heads 0-2 would use KV heads 0 and 1.
    pytest.param(
        {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3},
        2,
        "KV heads",
        id="kv-heads",
    ),
    pytest.param(
        {"hidden_size": 66, "num_key_value_heads": 4, "head_dim": 16},
        4,
        "conv channels (hidden_size)",
        id="conv-channels",
    ),
]


@pytest.mark.parametrize(("changes", "tp_size", "dimension"), BAD_TP)
def test_bad_tp_size_is_refused_before_any_actor(ckpt, tmp_path, changes, tp_size, dimension):
    model = config_only(ckpt, tmp_path / "cfg", **changes)
    was_up = ray.is_initialized()
    with pytest.raises(
        ConfigError, match=re.escape(f"tp_size={tp_size} does not divide {dimension}")
    ):
        LLM(model, tp_size=tp_size, dtype="float32", **SMALL)
    # Refused before Ray was even started, so no actor or placement group can exist.
    assert ray.is_initialized() == was_up


def test_zaya1_kv_heads_that_cannot_follow_their_queries_are_refused(tmp_path):
    if reason := transformers_lacks("zaya"):
        pytest.skip(reason)  # the one documented skip: no transformers to write the checkpoint
    zaya = make_tiny_checkpoint("zaya1", tmp_path / "z", seed=1, with_tokenizer=False)
    # 6 query / 3 KV heads at tp 2: a rank's query heads would straddle two KV heads.
    model = config_only(zaya, tmp_path / "cfg", num_attention_heads=6, num_key_value_heads=3)
    was_up = ray.is_initialized()
    with pytest.raises(ConfigError, match="tp_size=2 does not divide KV heads"):
        LLM(model, tp_size=2, dtype="float32", **SMALL)
    assert ray.is_initialized() == was_up


class _FailsToBuild:
    """A model class whose construction raises `error` (set per test)."""

    error: Exception = NotImplementedError("an op with no meta kernel")

    def __init__(self, *args: object) -> None:
        raise self.error


@pytest.mark.parametrize(
    ("error", "expected", "message"),
    [
        pytest.param(
            NotImplementedError("an op with no meta kernel"),
            RuntimeError,
            "pre-flight check of lfm2 could not run: .* NotImplementedError: an op with no meta",
            id="cannot-run",
        ),
        pytest.param(
            ValueError("tp_size=2 does not divide widgets = 3"),
            ConfigError,
            "lfm2: tp_size=2 does not divide widgets = 3",
            id="bad-split",
        ),
    ],
)
def test_tp_shard_preflight_never_passes_silently(ckpt, monkeypatch, error, expected, message):
    """The meta dry run either passes or refuses: a model that cannot be built there is an
    error (not a skipped check), raised before Ray is touched."""
    import workers.ray_executor as rx

    monkeypatch.setattr(_FailsToBuild, "error", error)
    monkeypatch.setattr(rx, "model_class", lambda arch: _FailsToBuild)
    spec = plan_worker_spec(ckpt, EngineConfig(**SMALL), "float32")
    with pytest.raises(expected, match=message) as info:
        rx.check_tp_shards(spec.model_cfg, spec.engine_cfg, 2)
    assert info.type is expected
    was_up = ray.is_initialized()
    with pytest.raises(expected, match=message):
        RayExecutor(spec, tp_size=2)
    assert ray.is_initialized() == was_up


def _live_placement_groups() -> int:
    return sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED")


def _kill_at_step(llm_or_engine: LLM | LLMEngine, rank: int, nth: int) -> None:
    """Kill TP rank `rank` just before the `nth` step from now is dispatched (mid-generation)."""
    engine = llm_or_engine.engine if isinstance(llm_or_engine, LLM) else llm_or_engine
    executor = engine.executor
    inner = executor.execute
    calls = [0]

    def execute(plan: StepPlan) -> StepResult:
        calls[0] += 1
        if calls[0] == nth:
            ray.kill(executor.workers[rank])
        return inner(plan)

    executor.execute = execute  # type: ignore[method-assign]


def test_worker_death_fails_generate_fast_and_a_new_llm_starts(ckpt, tmp_path):
    # Normally no Ray runs here, so LLM must start its own (and stop it below); a runtime left
    # by another test module is joined instead and must survive.
    preexisting = ray.is_initialized()
    base_groups = _live_placement_groups() if preexisting else 0
    llm = LLM(ckpt, tp_size=2, dtype="float32", **SMALL)
    assert ray.is_initialized()
    expected = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]

    _kill_at_step(llm, rank=1, nth=3)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"generation failed: .*TP rank 1 died"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert time.monotonic() - t0 < DETECT_WITHIN_S
    with pytest.raises(ExecutorError, match="TP rank 1 died"):
        llm.engine.executor.check_health()
    # A failed executor stays failed, at once, instead of hanging on a broken group.
    with pytest.raises(RuntimeError, match="generation failed"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)

    llm2 = LLM(ckpt, tp_size=2, dtype="float32", **SMALL)
    got = [o.token_ids for o in llm2.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    assert got == expected
    llm2.engine.executor.check_health()

    # A start-up failure inside the workers surfaces as itself and leaves nothing placed.
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(config_only(ckpt, tmp_path / "no-weights"), tp_size=2, dtype="float32", **SMALL)
    assert _live_placement_groups() == base_groups + 1  # llm2's; the failed ones are gone

    # An exception inside the ranks (not a death) also becomes a clear executor error.
    bad = SeqChunk(
        "bad", (5,), 0, slot=10_000, block_table=(1,), sampling=SamplingRow(GREEDY, 0, 0)
    )
    with pytest.raises(ExecutorError, match=r"TP worker failed: \w+Error"):
        llm2.engine.executor.execute(StepPlan(step_id=10_000, seqs=(bad,)))

    assert _live_placement_groups() == base_groups  # a failed executor lets go at once

    llm.shutdown()
    assert ray.is_initialized(), "llm2 still uses the runtime"
    llm2.shutdown()
    assert ray.is_initialized() == preexisting, "the runtime LLM started goes with its last user"


def test_actor_dispatch_rank0_death_and_idle_death_found_by_health_check(ckpt):
    """The plain actor-call dispatch, killing rank 0 (the one that returns results); then a
    rank that dies between steps is found by check_health alone."""
    owned = acquire_runtime(num_cpus=2)
    try:
        eng_cfg = EngineConfig(**SMALL)
        spec = plan_worker_spec(ckpt, eng_cfg, "float32")
        executor = RayExecutor(spec, tp_size=2, dispatch="actor")
        engine = LLMEngine(spec, executor)
        _kill_at_step(engine, rank=0, nth=3)
        for p in PROMPTS:
            engine.add_request(p, GREEDY)
        t0, errors = time.monotonic(), []
        while engine.has_unfinished() and not errors:
            errors = [o.error for o in engine.step() if o.error]
        assert time.monotonic() - t0 < DETECT_WITHIN_S
        assert errors and "TP rank 0 died" in errors[0]
        with pytest.raises(ExecutorError, match="TP rank 0 died"):
            executor.check_health()
        engine.shutdown()

        idle = RayExecutor(spec, tp_size=2)
        idle.check_health()
        ray.kill(idle.workers[1])
        t0 = time.monotonic()
        # NOTE: ray.kill returns before the actor is gone; a check that still reaches it is
        # right to pass, so the health checks (as the replica's periodic one) repeat.
        with pytest.raises(ExecutorError, match=r"TP rank 1 died \(found by a health check\)"):
            while time.monotonic() - t0 < DETECT_WITHIN_S:
                idle.check_health()
                time.sleep(0.2)
        assert time.monotonic() - t0 < DETECT_WITHIN_S
        with pytest.raises(ExecutorError, match="TP rank 1 died"):
            idle.execute(StepPlan(step_id=0, seqs=()))
        idle.shutdown()
    finally:
        if owned:
            release_runtime()
