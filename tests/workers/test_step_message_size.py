"""The step message of a decode step does not grow with context length: the same pickled
bytes (protocol 5) at 100 and at 4,000 tokens of context, at TP 1 (LocalExecutor) and at TP 2
(RayExecutor: real Ray actors joined over gloo), where the full StepPlan grows by KiB."""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray_env import private_ray  # noqa: E402

from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.engine.plan import StepPlan, StepResult  # noqa: E402
from shortconv.execution.local_executor import LocalExecutor  # noqa: E402
from shortconv.execution.worker_spec import WorkerSpec, plan_worker_spec  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from workers.ray_executor import RayExecutor  # noqa: E402

pytestmark = pytest.mark.timeout(600)

CONTEXTS = (100, 4000)
# A plain greedy row and one whose penalties read the request's whole history.
PARAMS = (
    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=1.1),
)
# 8 query / 2 KV heads (one KV head per rank at TP 2); long enough for 4,000 tokens.
OVERRIDES = {"num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 8192}


def engine_config() -> EngineConfig:
    return EngineConfig(
        max_num_seqs=2,
        num_state_slots=5,
        num_checkpoint_slots=2,
        # 64-token pages: neither context's decode steps start a new page, so every decode
        # step here carries the same kinds of change (a page appended is one more edit).
        num_kv_pages=2 * 4100 // 64 + 8,
        kv_page_size=64,
        max_num_batched_tokens=8192,
        # The second prompt in one chunk while the first decodes: two rows decode from then on.
        max_prefill_tokens_while_decoding=8192,
    )


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> WorkerSpec:
    ckpt: Path = make_tiny_checkpoint(
        "lfm2", tmp_path_factory.mktemp("lfm2"), OVERRIDES, seed=7, with_tokenizer=False
    )
    return plan_worker_spec(ckpt, engine_config(), "float32")


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[None]:
    with private_ray("scmsg-", num_cpus=2):
        yield


class _Sizes:
    """Executor stand-in: per decode step of both rows, the pickled bytes of the message the
    executor sent and of the full plan it was encoded from."""

    def __init__(self, executor: LocalExecutor | RayExecutor) -> None:
        self.executor = executor
        self.message: list[int] = []
        self.plan: list[int] = []

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.executor.execute(plan)
        if plan.is_decode and len(plan.seqs) == len(PARAMS):
            self.message.append(len(pickle.dumps(self.executor.last_message, protocol=5)))
            self.plan.append(len(pickle.dumps(plan, protocol=5)))
        return result


def decode_sizes(spec: WorkerSpec, executor: LocalExecutor | RayExecutor, ctx: int) -> _Sizes:
    engine = LLMEngine(spec, executor)
    sizes = _Sizes(executor)
    engine.executor = sizes  # type: ignore[assignment]
    rng = random.Random(ctx)
    for i, params in enumerate(PARAMS):
        prompt = [rng.randrange(3, 500) for _ in range(ctx)]
        engine.add_request(prompt, params, request_id=f"ctx{ctx}-{i}")
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
    assert len(sizes.message) >= PARAMS[0].max_tokens - 2
    return sizes


def check_flat(spec: WorkerSpec, executor: LocalExecutor | RayExecutor) -> None:
    short, long = (decode_sizes(spec, executor, ctx) for ctx in CONTEXTS)
    print(f"decode step message bytes at {CONTEXTS}: {short.message}, {long.message}")
    print(f"full StepPlan bytes at {CONTEXTS}: {short.plan[-1]}, {long.plan[-1]}")
    assert len(set(short.message)) == 1, short.message
    assert set(long.message) == set(short.message)
    # The plan it replaces grows with the context (block tables, penalty history).
    assert long.plan[-1] > short.plan[-1] + 4000
    assert long.message[-1] < short.plan[-1]


def test_decode_message_size_is_flat_at_tp1(spec: WorkerSpec) -> None:
    executor = LocalExecutor(spec, step_messages=True)
    try:
        check_flat(spec, executor)
    finally:
        executor.shutdown()


def test_decode_message_size_is_flat_at_tp2(spec: WorkerSpec, ray_runtime: None) -> None:
    executor = RayExecutor(spec, 2, num_cpus_per_worker=0.25)
    try:
        check_flat(spec, executor)
        # Both ranks hold what the driver's mirror holds (the requests that finished in the
        # last step are dropped by the next step's message, which never came here).
        assert executor.call_workers("batch_request_ids") == [sorted(executor.encoder.rows)] * 2
    finally:
        executor.shutdown()
