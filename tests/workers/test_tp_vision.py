"""LFM2-VL and LFM3-VL at tp_size 2 on Ray (CPU, gloo): transformers' greedy tokens for one
image, for a batch mixing image and text requests split over chunks, and for a prefix-cache
hit on the image. Each step's plan carries its images to every rank, whose
replicated encoder embeds them (docs/vision.md), so every rank places the same rows."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

ray = pytest.importorskip("ray")

from lfm3_vl_inputs import Lfm3VlCase, Pic, Request, lfm3_vl_case  # noqa: E402
from oracle import OracleRun, assert_matches_oracle  # noqa: E402
from ray_env import private_ray  # noqa: E402
from vision_inputs import Image, VisionCase, engine_images, vision_case  # noqa: E402

from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.engine.plan import StepPlan  # noqa: E402
from shortconv.execution.worker_spec import WorkerSpec, plan_worker_spec  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from workers.ray_executor import RayExecutor  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
UNTILED = Image(((6, 8),))  # 12 tokens
TILED = Image.tiled(1, 2, (4, 8))  # two 4-token tiles and an 8-token thumbnail
# Fixed pools: the module's engines share one executor, so their capacity must agree.
CONFIG = EngineConfig(
    max_num_seqs=4,
    num_state_slots=9,
    num_checkpoint_slots=7,
    num_kv_pages=48,
    kv_page_size=8,
    prefix_checkpoint_interval=8,
)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> VisionCase:
    return vision_case(tmp_path_factory.mktemp("lfm2_vl"), MAX_NEW)


@pytest.fixture(scope="module")
def lfm3_case(tmp_path_factory: pytest.TempPathFactory) -> Lfm3VlCase:
    return lfm3_vl_case(tmp_path_factory.mktemp("lfm3_vl"), MAX_NEW)


@pytest.fixture(scope="module")
def private_cluster():
    with private_ray("sctpv-", num_cpus=2):
        yield


def _executor(path) -> Iterator[tuple[WorkerSpec, RayExecutor]]:
    spec = plan_worker_spec(path, CONFIG, "float32")
    executor = RayExecutor(spec, 2, num_cpus_per_worker=0.5)
    yield spec, executor
    executor.shutdown()


@pytest.fixture(scope="module")
def tp2(private_cluster, case: VisionCase):
    yield from _executor(case.path)


@pytest.fixture(scope="module")
def lfm3_tp2(private_cluster, lfm3_case: Lfm3VlCase):
    yield from _executor(lfm3_case.path)


def tp2_engine(tp2: tuple[WorkerSpec, RayExecutor], budget: int = 512) -> LLMEngine:
    spec, executor = tp2
    config = replace(CONFIG, max_num_batched_tokens=budget)
    return LLMEngine(replace(spec, engine_cfg=config), executor)


def serve(engine: LLMEngine, case: VisionCase, requests: list) -> tuple[list[int], list[StepPlan]]:
    """Run LFM2-VL (ids, batch, images) requests together; each must equal transformers.
    Returns each request's cached prompt tokens and the plans."""
    feed = [(ids, engine_images(imgs, b) if b else []) for ids, b, imgs in requests]
    return run_all(engine, feed, [case.oracle(ids, b) for ids, b, _ in requests])


def run_all(
    engine: LLMEngine, feed: list[tuple[list[int], list]], oracles: list[OracleRun]
) -> tuple[list[int], list[StepPlan]]:
    """Run (ids, images) requests together; each must equal its oracle run."""
    plans: list[StepPlan] = []
    executor = engine.executor
    engine.executor = _Recording(executor, plans)  # type: ignore[assignment]
    rids = [engine.add_request(ids, GREEDY, images=images) for ids, images in feed]
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    engine.executor = executor
    for i, (rid, ref) in enumerate(zip(rids, oracles, strict=True)):
        assert done[rid].error is None, done[rid].error
        assert_matches_oracle(done[rid].token_ids, ref, f"tp 2, request {i}")
    return [done[rid].num_cached_tokens for rid in rids], plans


class _Recording:
    def __init__(self, executor: RayExecutor, plans: list[StepPlan]) -> None:
        self._executor, self.plans = executor, plans

    def execute(self, plan: StepPlan):
        self.plans.append(plan)
        return self._executor.execute(plan)


def test_tp2_one_image(tp2, case: VisionCase) -> None:
    serve(tp2_engine(tp2), case, [case.request([("user", [UNTILED, "What is this?"])])])


def test_tp2_batch_mixing_image_and_text_over_chunks(tp2, case: VisionCase) -> None:
    requests = [
        case.request([("user", ["Only text here."])]),
        case.request([("user", [UNTILED, "One image."])], seed=1),
        case.request([("user", ["Two:", TILED, UNTILED])], seed=2),
    ]
    _, plans = serve(tp2_engine(tp2, budget=16), case, requests)
    assert any(s.src > 0 for p in plans for seq in p.seqs for s in seq.images), "split images"


def test_tp2_prefix_cache_hit_on_the_image(tp2, case: VisionCase) -> None:
    request = case.request([("user", [TILED, "Again?"])], seed=3)
    engine = tp2_engine(tp2)
    serve(engine, case, [request])
    (cached,), plans = serve(engine, case, [request])
    last_image_token = max(
        i for i, t in enumerate(request[0]) if t == case.hf.config.image_token_id
    )
    assert cached > last_image_token and not any(p.encoder_inputs for p in plans)


def serve_lfm3(
    engine: LLMEngine, case: Lfm3VlCase, requests: list[Request]
) -> tuple[list[int], list[StepPlan]]:
    feed = [(r.ids, r.images) for r in requests]
    return run_all(engine, feed, [case.oracle(r) for r in requests])


def test_tp2_lfm3_vl_one_image(lfm3_tp2, lfm3_case: Lfm3VlCase) -> None:
    request = lfm3_case.request([("user", [Pic(20, 44), "What?"])])
    serve_lfm3(tp2_engine(lfm3_tp2), lfm3_case, [request])


def test_tp2_lfm3_vl_batch_mixing_image_and_text_over_chunks(
    lfm3_tp2, lfm3_case: Lfm3VlCase
) -> None:
    requests = [
        lfm3_case.request([("user", ["Only text here."])]),
        lfm3_case.request([("user", [Pic(20, 44, seed=1), "One image."])]),
        lfm3_case.request([("user", ["Two:", Pic(32, 32, seed=2), Pic(40, 16, seed=3)])]),
    ]
    _, plans = serve_lfm3(tp2_engine(lfm3_tp2, budget=16), lfm3_case, requests)
    assert any(s.src > 0 for p in plans for seq in p.seqs for s in seq.images), "split images"


def test_tp2_lfm3_vl_prefix_cache_hit_on_the_image(lfm3_tp2, lfm3_case: Lfm3VlCase) -> None:
    request = lfm3_case.request([("user", [Pic(32, 32, seed=5), "Again?"])])
    engine = tp2_engine(lfm3_tp2)
    serve_lfm3(engine, lfm3_case, [request])
    (cached,), plans = serve_lfm3(engine, lfm3_case, [request])
    image_id = lfm3_case.hf.config.image_token_id
    last_image_token = max(i for i, t in enumerate(request.ids) if t == image_id)
    assert cached > last_image_token and not any(p.encoder_inputs for p in plans)
