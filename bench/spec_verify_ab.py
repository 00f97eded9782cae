"""Verify-step cost against a decode step, with and without the verify step's once-per-step
resolution, in one process (A/B on a shared machine).

    .venv/bin/python bench/spec_verify_ab.py --shape lfm2-350m --threads 2 --quantizations none,int8

One engine per weight kind, one request with the 128-token prompt of bench/spec_decode.py;
rounds alternate decode steps (speculation off), verify steps of exactly k + 1 tokens as the
step resolves them (`StepTensors.verify`: each short conv's checkpoints and state in one
scatter, `conv1d_verify_cpu.verify_conv1d_cpu`), and the same verify steps with that
resolution off (`step_inputs.build_verify_rows` returns None: each layer writes its
checkpoints and checks its rows itself, what every verify step ran before). Prints the lower
quartile of each kind's step times (load only adds time) and each verify kind's ratio to the
decode step.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import spec_decode  # noqa: E402
from offline import SHAPES  # noqa: E402
from spec_decode import PROMPT, _engine, _force_proposals, step_times  # noqa: E402
from spec_profile import step_args  # noqa: E402

import shortconv.execution.step_inputs as step_inputs  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402


def _unresolved(plan: object, device: object) -> None:
    return None


def _q25(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 4]


def main() -> None:
    args = step_args(__doc__, ("quantizations", "none,int8"))
    if args.cpu_time:
        spec_decode.time.perf_counter = time.process_time
    arch, overrides = SHAPES[args.shape]
    resolved = step_inputs.build_verify_rows
    rng = random.Random(0)
    clock = "process CPU" if args.cpu_time else "wall"
    print(
        f"# {args.shape}, threads {args.threads}, k = {args.k}; {clock} ms a step (lower quartile)"
    )
    print("| weights | decode | verify, per-layer | verify, resolved per step |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(arch, Path(tmp) / "ckpt", overrides, seed=0)
        for q in args.quantizations.split(","):
            llm = _engine(path, args.k, **({} if q == "none" else {"quantization": q}))
            _force_proposals(llm, args.k)
            vocab = llm.engine.model_cfg.vocab_size
            prompt = [rng.randrange(3, vocab) for _ in range(PROMPT)]
            times: dict[str, list[float]] = {"decode": [], "per_layer": [], "resolved": []}
            for r in range(args.rounds + 1):
                for kind in times:
                    step_inputs.build_verify_rows = (  # type: ignore[assignment]
                        _unresolved if kind == "per_layer" else resolved
                    )
                    got = step_times(llm, prompt, args.steps, kind != "decode")
                    if r:  # round 0 warms up
                        times[kind] += got
            step_inputs.build_verify_rows = resolved
            llm.shutdown()
            d, ref, new = (_q25(times[k]) * 1e3 for k in ("decode", "per_layer", "resolved"))
            print(f"| {q} | {d:.1f} | {ref:.1f} ({ref / d:.2f}x) | {new:.1f} ({new / d:.2f}x) |")


if __name__ == "__main__":
    main()
