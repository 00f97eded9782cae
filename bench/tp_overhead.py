"""Per-step executor overhead of tensor-parallel dispatch on Ray (CPU, gloo).

    .venv/bin/python bench/tp_overhead.py [--quick] [--model DIR] [--dispatch actor compiled]

For each dispatch method and tp_size in (1, 2), a tiny checkpoint decodes a small batch; every
step's wall time at the executor (`RayExecutor.execute`) is compared with the time rank 0 spent
inside `ModelRunner.execute` (step tensors + forward + sampling, timed in the worker). The
difference is what the executor adds: plan serialisation, the fan-out, the result's way back.
An in-process LocalExecutor (tp_size=1, no Ray) is printed as the floor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.engine.executor import BaseExecutor  # noqa: E402
from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.engine.plan import StepPlan, StepResult  # noqa: E402
from shortconv.execution.worker_spec import plan_worker_spec  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402

TARGET_MS = 2.0


def make_engine(model: Path, tp_size: int, dispatch: str | None) -> LLMEngine:
    """An engine whose executor is chosen here (LocalExecutor when dispatch is None)."""

    eng = EngineConfig(max_num_seqs=8, num_kv_pages=64, num_state_slots=17)
    spec = plan_worker_spec(model, eng, "float32")
    if dispatch is None:
        from shortconv.execution.local_executor import LocalExecutor

        ex: BaseExecutor = LocalExecutor(spec)
    else:
        from workers.ray_executor import RayExecutor

        ex = RayExecutor(spec, tp_size=tp_size, dispatch=dispatch)
    return LLMEngine(spec, ex)


def run(engine: LLMEngine, batch: int, steps: int) -> dict[int, float]:
    """Decode `steps` tokens for `batch` prompts; wall seconds of every executor step."""
    walls: dict[int, float] = {}
    inner = engine.executor.execute

    def timed(plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        out = inner(plan)
        walls[plan.step_id] = time.perf_counter() - t0
        return out

    engine.executor.execute = timed  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for b in range(batch):
        engine.add_request([5 + b, 9, 13, 20 + b], params)
    while engine.has_unfinished():
        engine.step()
    engine.executor.execute = inner  # type: ignore[method-assign]
    return walls


def measure(model: Path, tp_size: int, dispatch: str | None, batch: int, steps: int) -> dict:
    engine = make_engine(model, tp_size, dispatch)
    try:
        run(engine, batch, 4)  # warm-up: first-call costs (allocation, channel set-up)
        if dispatch is not None:
            engine.executor.call_workers("pop_timings")  # type: ignore[attr-defined]
        walls = run(engine, batch, steps)
        if dispatch is None:
            inner = {}
        else:
            rank0 = engine.executor.call_workers("pop_timings")[0]  # type: ignore[attr-defined]
            inner = dict(rank0)
    finally:
        engine.shutdown()
    overhead = [(w - inner.get(s, w)) * 1e3 for s, w in walls.items()]
    return {
        "wall_ms": statistics.median(walls.values()) * 1e3,
        "overhead_ms": statistics.median(overhead) if inner else 0.0,
        "overhead_p90_ms": _p90(overhead) if inner else 0.0,
        "steps": len(walls),
    }


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI size: few steps, one batch size")
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: tiny LFM2)")
    p.add_argument("--dispatch", nargs="+", default=["actor", "compiled"])
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args(argv)
    steps = 24 if args.quick else 128

    from workers.ray_runtime import acquire_runtime, release_runtime

    with tempfile.TemporaryDirectory(prefix="tpbench-") as tmp:
        model = args.model
        if model is None:
            from shortconv.tiny.checkpoint import make_tiny_checkpoint

            model = make_tiny_checkpoint("lfm2", Path(tmp) / "lfm2", seed=0, with_tokenizer=False)
        # The floor first, before Ray's own processes compete for the cores; one torch thread,
        # as Ray gives each worker (OMP_NUM_THREADS=1), so the step times compare.
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        rows = [("local", 1, measure(model, 1, None, args.batch, steps))]
        torch.set_num_threads(threads)
        acquire_runtime(num_cpus=2)
        try:
            for dispatch in args.dispatch:
                for tp in (1, 2):
                    rows.append((dispatch, tp, measure(model, tp, dispatch, args.batch, steps)))
        finally:
            release_runtime()
    print(f"\nper-step executor overhead, batch={args.batch} decode, {steps} steps, CPU/gloo")
    print(f"{'dispatch':>9} {'tp':>3} {'step ms':>9} {'overhead ms':>12} {'p90 ms':>8}")
    for dispatch, tp, r in rows:
        print(
            f"{dispatch:>9} {tp:>3} {r['wall_ms']:>9.2f} {r['overhead_ms']:>12.2f} "
            f"{r['overhead_p90_ms']:>8.2f}"
        )
    tp2 = {d: r["overhead_ms"] for d, tp, r in rows if tp == 2}
    if tp2:
        best = min(tp2, key=tp2.__getitem__)
        verdict = "meets" if tp2[best] < TARGET_MS else "misses"
        print(f"fastest at tp_size=2: {best} ({tp2[best]:.2f} ms; {verdict} {TARGET_MS} ms target)")


if __name__ == "__main__":
    main()
