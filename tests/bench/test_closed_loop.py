"""bench/closed_loop.py: the offline engine under the serving benchmark's closed loop."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from closed_loop import closed_loop  # noqa: E402

from shortconv.llm import build_engine  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402


def test_every_request_runs_to_its_length_with_at_most_conc_in_flight(tmp_path: Path) -> None:
    engine = build_engine(make_tiny_checkpoint("lfm2", tmp_path / "ckpt", seed=0), dtype="float32")
    seen: list[int] = []
    step = engine.step

    def counting_step():  # noqa: ANN202 - LLMEngine.step's own result
        seen.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return step()

    engine.step = counting_step  # type: ignore[method-assign]
    args = argparse.Namespace(seed=0, prompt_tokens=12, max_tokens=5)
    try:
        got = closed_loop(engine, conc=2, requests=5, args=args)
    finally:
        engine.shutdown()
    assert max(seen) == 2 and seen.count(2) > len(seen) // 2  # refilled as requests finish
    assert got["tokens"] == 5 * 5  # every request ran to its length, none twice
    # The rates and gaps are real timings, so only their sanity is held.
    assert got["tok_s"] > 0
    assert 0 < got["itl_p50"] <= got["itl_p99"]
    assert got["ttft_p50"] > 0 and got["tpot_p50"] > 0
