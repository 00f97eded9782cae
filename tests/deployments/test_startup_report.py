"""The replica's start-up report: each phase of the start path timed in order, the process's
life before it, the resident memory, logged at start and kept for the replica's stats."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from deployments.frontend.config.args import AppArgs
from deployments.serve.server import build_engine, startup_summary
from shortconv.tiny.checkpoint import make_tiny_checkpoint
from workers.startup import PhaseClock, process_age_s, rss_bytes

# "prepack" joins them only with EngineConfig.prepack_cpu_weights (off by default), "quantize"
# only with quantization; "cpu_kernels" (build or load of the AVX2 kernels) runs on CPU,
# before the weights: which layers take those kernels is bound when the model is built.
RUNNER_PHASES = ["cpu_kernels", "weights", "state_pool"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=5)


def test_start_path_reports_its_phases_and_memory(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = AppArgs(model=str(ckpt), dtype="float32", device="cpu", max_num_seqs=4)
    clock = PhaseClock()
    engine = build_engine(args, clock=clock)
    try:
        names = [name for name, _ in clock.phases]
        assert names == ["checkpoint", *RUNNER_PHASES, "engine"]
        assert all(s >= 0 for _, s in clock.phases)
        report = clock.report("replica")
        assert report.rss_bytes > 50 * 2**20  # torch and the model are in it
        assert report.total_s >= sum(s for _, s in clock.phases)
        with caplog.at_level(logging.INFO, logger="ray.serve"):
            summary = startup_summary(report, 2, engine)
        (line,) = [r.getMessage() for r in caplog.records if "replica start:" in r.getMessage()]
        for name in names:
            assert f" {name} " in line
        assert "RSS" in line and "MiB" in line and "torch threads 2" in line
        assert summary["torch_threads"] == 2 and summary["ranks"] == []
        assert [p[0] for p in summary["phases"]] == names
        assert summary["rss_bytes"] == report.rss_bytes
    finally:
        engine.shutdown()


def test_process_age_and_rss_are_this_process() -> None:
    age = process_age_s()
    assert 0 < age < 24 * 3600  # pytest started it moments (or minutes) ago
    assert rss_bytes() > 10 * 2**20
    clock = PhaseClock()
    with clock.phase("a"):
        pass
    assert clock.before_s >= age and [n for n, _ in clock.phases] == ["a"]
