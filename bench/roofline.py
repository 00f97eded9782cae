"""Decode-step roofline on this machine: measured peak, floor time, achieved / floor.

    .venv/bin/python bench/roofline.py                         # LFM2-350M shape, batch 1 and 32
    .venv/bin/python bench/roofline.py --quick                 # tiny shape, seconds

In one run: (1) the machine's fp32 matmul FLOP/s with torch (the best of `torch.mm` and the
oneDNN inner product the engine uses, on large square operands) and its memory bandwidth (a
large tensor copy, read + write bytes); (2) the floor time of one decode step at batch B and
context L = max(FLOPs / peak FLOP/s, bytes / bandwidth), where FLOPs count every weight matmul
(LM head included), attention scores and values, and the short conv, and bytes count every
weight read once plus the KV read and written and the conv state read and written; (3) the
engine's achieved time per decode step (whole `LLMEngine.step()`, and its model forward + LM
head alone), after prefilling B requests of L tokens. Achieved / floor >= 1; the target
is floor / achieved >= 60% at batch 32. Peaks are measured right before and after the decode
runs and the higher is used, so load from other processes lowers the peak less than the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import offline  # noqa: E402
import profile_step  # noqa: E402

from shortconv.configs.config import ModelConfig  # noqa: E402
from shortconv.layers.linear_float import dense_linear as linear  # noqa: E402


def _best(fn: object, reps: int) -> float:
    """Fastest of `reps` timed calls after one warm-up (a peak, not a typical time)."""
    fn()  # type: ignore[operator]
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return best


def peak_flops(n: int, reps: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    with torch.inference_mode():
        t_mm = _best(lambda: torch.mm(a, b), reps)
        t_dnn = _best(lambda: linear(a, b), reps)
    return 2 * n**3 / min(t_mm, t_dnn)


def copy_bandwidth(mib: int, reps: int) -> float:
    src = torch.ones(mib << 18)  # float32: 4 bytes each
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), reps)


def step_cost(cfg: ModelConfig, batch: int, context: int, itemsize: int = 4) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step of `batch` rows at `context` tokens."""
    h, v = cfg.hidden_size, cfg.vocab_size
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    weights, flops, state = 0, 0.0, 0.0
    for kind in cfg.layer_types:
        if kind == "conv":
            mixer = 3 * h * h + h * h
            flops += 2 * batch * h * cfg.conv_width
            state += 2 * batch * h * (cfg.conv_width - 1)  # read and write
        else:
            mixer = (hq + 2 * hk) * d * h + hq * d * h
            flops += 4 * batch * context * hq * d  # q.k and p.v
            state += 2 * batch * hk * d * (context + 1)  # K and V read, the new row written
        ffn = 3 * h * cfg.intermediate_size
        weights += mixer + ffn
        flops += 2 * batch * (mixer + ffn)
    weights += v * h  # LM head (tied to the embedding: one read covers both)
    flops += 2 * batch * v * h
    return flops, (weights + state) * itemsize


def measure_peaks(reps: int, quick: bool) -> tuple[float, float]:
    return peak_flops(512 if quick else 2048, reps), copy_bandwidth(32 if quick else 512, reps)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(offline.SHAPES), default="lfm2-350m")
    p.add_argument("--model", help="a checkpoint directory instead of --shape")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--ckpt-dir")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.batches, args.context, args.steps, args.runs = "lfm2-tiny", "1,4", 32, 4, 2
    torch.set_num_threads(args.threads)
    args.seed = 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, name = offline.prepare_model(args, tmp)
        run(args, model_dir, name)


def run(args: argparse.Namespace, model_dir: Path, name: str) -> None:
    reps = 3 if args.quick else 5
    flops_a, bw_a = measure_peaks(reps, args.quick)
    cfg = ModelConfig.from_dir(model_dir)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        ns = argparse.Namespace(context=args.context, runs=args.runs, steps=args.steps, py_spy=None)
        llm = profile_step.make_llm(model_dir, False, ns)
        timer = profile_step.ForwardTimer(llm.engine.executor.runner.model)
        profile_step.prefill(llm, batch, args.context, profile_step.budget(ns)[0], cfg.vocab_size)
        profile_step.decode_steps(llm, timer, args.steps)  # warm-up
        ms = [profile_step.decode_steps(llm, timer, args.steps) for _ in range(args.runs)]
        step, fwd = statistics.median(s for s, _ in ms), statistics.median(f for _, f in ms)
        mid = args.context + args.steps * (args.runs + 2) // 2  # the runs' mean context
        flops, nbytes = step_cost(cfg, batch, mid)
        rows.append((batch, step, fwd, flops, nbytes))
        llm.shutdown()
    flops_b, bw_b = measure_peaks(reps, args.quick)
    peak, bw = max(flops_a, flops_b), max(bw_a, bw_b)
    print(
        f"# roofline {name}: threads {torch.get_num_threads()}, peak {peak / 1e9:.1f} GFLOP/s "
        f"(before {flops_a / 1e9:.1f}, after {flops_b / 1e9:.1f}), copy bandwidth "
        f"{bw / 1e9:.1f} GB/s (before {bw_a / 1e9:.1f}, after {bw_b / 1e9:.1f}), "
        f"load avg {os.getloadavg()[0]:.2f}"
    )
    for batch, step, fwd, flops, nbytes in rows:
        t_c, t_m = flops / peak, nbytes / bw
        floor = max(t_c, t_m)
        bound = "compute" if t_c >= t_m else "memory"
        print(
            f"SUMMARY roofline shape={name} batch={batch} context={args.context} "
            f"gflop={flops / 1e9:.2f} mbytes={nbytes / 1e6:.0f} floor_ms={floor * 1e3:.2f} "
            f"({bound}) step_ms={step * 1e3:.2f} forward_ms={fwd * 1e3:.2f} "
            f"floor/step={floor / step:.2f} floor/forward={floor / fwd:.2f}"
        )


if __name__ == "__main__":
    main()
