"""Speculative decoding at TP 2 (Ray actors, gloo): speculation on equals speculation off, on
every text architecture and on LFM2-VL and LFM3-VL with an image.

Nothing in a verify row is rank-specific (acceptance is the scheduler's, the rollback is slot
ids in the plan), so one RayExecutor per architecture serves both engines: it is planned with
the speculative config (its pools hold the spec slots) and the engine with speculation off
uses the same pools. The draft model runs on the driver, unsharded, beside the scheduler."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")


from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.execution.worker_spec import WorkerSpec, plan_worker_spec  # noqa: E402
from tests.engine.test_spec_decode import (  # noqa: E402
    GREEDY,
    LONG,
    PROMPTS,
    SPEC,
    assert_accepts_and_rejects,
    assert_nothing_held,
    assert_same,
    make_ckpt,
    run,
)
from tests.engine.test_spec_vision import (  # noqa: E402
    VlModel,
    make_vl,
    run_requests,
    spec_config,
    spec_counts,
)
from tests.workers.test_tp import ray_runtime  # noqa: E402, F401 (the module's Ray runtime)
from workers.ray_executor import RayExecutor  # noqa: E402

KW = {"kv_page_size": 4, "max_num_batched_tokens": 16, "max_prefill_tokens_while_decoding": 8}
OFF = replace(GREEDY, max_tokens=24, speculative=False)
PARAMS = [replace(GREEDY, max_tokens=24), OFF, replace(GREEDY, max_tokens=24)] * 2


@dataclass
class Tp2:
    ckpt: Path
    spec: WorkerSpec
    executor: RayExecutor

    def engine(self, speculative: dict[str, object] | None) -> LLMEngine:
        cfg = EngineConfig(speculative_config=speculative, **KW)  # type: ignore[arg-type]
        return LLMEngine(replace(self.spec, engine_cfg=cfg), self.executor)


@pytest.fixture(scope="module", params=["lfm2", "zaya1", "lfm3", "lfm2_moe"])
def tp2(request, ray_runtime, tmp_path_factory) -> Iterator[Tp2]:  # noqa: ANN001, F811
    ckpt = make_ckpt(request.param, tmp_path_factory.mktemp(request.param))
    spec = plan_worker_spec(ckpt, EngineConfig(speculative_config=SPEC, **KW), "float32")  # type: ignore[arg-type]
    executor = RayExecutor(spec, 2, num_cpus_per_worker=0.5)
    yield Tp2(ckpt, spec, executor)
    executor.shutdown()


def check(tp2: Tp2, speculative: dict[str, object]) -> LLMEngine:
    """A batch mixed with a non-speculating request and a chunked prompt, on and off."""
    prompts = [*PROMPTS, LONG, PROMPTS[0], PROMPTS[1]]
    ref = run(tp2.engine(None), prompts, PARAMS)
    eng = tp2.engine(speculative)
    assert_same(run(eng, prompts, PARAMS), ref)
    assert_accepts_and_rejects(eng)
    assert_nothing_held(eng)
    return eng


def test_ngram_at_tp2(tp2: Tp2) -> None:
    check(tp2, SPEC)


def test_draft_model_on_the_driver_at_tp2(tp2: Tp2, tmp_path: Path) -> None:
    """A draft of another architecture: ZAYA1 (CCA) for every target but ZAYA1, LFM2 for it."""
    other = "lfm2" if tp2.spec.model_cfg.arch == "zaya1" else "zaya1"
    draft = make_ckpt(other, tmp_path / other)
    eng = check(tp2, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    assert eng.scheduler.speculator.draft.num_held() == (0, 0)  # type: ignore[union-attr]


@pytest.fixture(scope="module", params=["lfm2_vl", "lfm3_vl"])
def vl_tp2(
    request,  # noqa: ANN001
    ray_runtime,  # noqa: ANN001, F811
    tmp_path_factory,  # noqa: ANN001
) -> Iterator[tuple[VlModel, WorkerSpec, RayExecutor]]:
    vl = make_vl(request.param, tmp_path_factory.mktemp(request.param))
    spec = plan_worker_spec(vl.path, spec_config(vl, "ngram"), "float32")
    executor = RayExecutor(spec, 2, num_cpus_per_worker=0.5)
    yield vl, spec, executor
    executor.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_an_image_request_speculates_losslessly_at_tp2(
    vl_tp2: tuple[VlModel, WorkerSpec, RayExecutor], method: str
) -> None:
    """The image request, a text one and a non-speculating one (test_spec_vision's), with
    the pools planned for speculation; the draft runs on the driver."""
    vl, spec, executor = vl_tp2

    def engine(m: str | None) -> LLMEngine:
        return LLMEngine(replace(spec, engine_cfg=spec_config(vl, m)), executor)

    ref = run_requests(engine(None), vl)
    eng = engine(method)
    assert run_requests(eng, vl) == ref
    assert ref[0] != ref[1]  # the image request is not the text one
    proposed, accepted = spec_counts(eng)
    assert accepted < proposed, (proposed, accepted)
    assert_nothing_held(eng)
