"""The AVX2 linears (shortconv/kernels/cpu_gemm.cpp) against torch's paths, per weight.

    .venv/bin/python bench/cpu_gemm.py            # fp32 and q8 against oneDNN, 1..256 rows
    .venv/bin/python bench/cpu_gemm.py --one      # one 131072 x 1024 weight, 1 and 2 threads
    .venv/bin/python bench/cpu_gemm.py --crossover  # per LFM2-350M linear shape: tile vs torch

Weights are LFM2-350M's MLP shapes (8 of 4608 x 1024, 4 of 1024 x 4608: 302 MB of fp32, past
the caches); each line is the best of 3 passes over all of them. "q8 widened" is the weight
widened to fp32 per call, then oneDNN (what the kernel's q8 path saves).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shortconv.kernels import cpu_gemm as cg  # noqa: E402
from shortconv.layers.linear_float import cpu_float_method  # noqa: E402
from shortconv.layers.linear_float import dense_linear as linear  # noqa: E402

# Every linear shape (out x in) of the LFM2-350M bench shape (bench/offline.py): the conv's in
# and out projections, attention's q, k/v and o, the MLP's w1/w3 and w2, the LM head.
LFM2_350M_SHAPES = {
    "conv in 3072x1024": (3072, 1024),
    "q/o/conv out 1024x1024": (1024, 1024),
    "k/v 512x1024": (512, 1024),
    "w1/w3 4608x1024": (4608, 1024),
    "w2 1024x4608": (1024, 4608),
    "head 65536x1024": (65536, 1024),
}
# Copies of a small weight cycled per pass, so a pass reads memory as a decode step does, not a
# weight that sits in L2.
PASS_BYTES = 64 << 20


ROWS = "1,2,4,8,16,32,64,128,256"


def best_of(fn, runs: int = 3) -> float:  # noqa: ANN001 - a no-argument callable
    fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def per_weight(rows: list[int]) -> None:
    ws = [torch.randn(4608, 1024) for _ in range(8)] + [torch.randn(1024, 4608) for _ in range(4)]
    qs = [cg.quantize_q8(w) for w in ws]
    print("| rows | fp32 ours | fp32 oneDNN | q8 ours | q8 widened + oneDNN |")
    print("| --- | --- | --- | --- | --- |")
    for m in rows:
        pairs = [(w, q, torch.randn(m, w.shape[1])) for w, q in zip(ws, qs, strict=True)]
        cells = [
            best_of(lambda p=pairs: [cg.gemm_f32(x, w, None) for w, _, x in p]),
            best_of(lambda p=pairs: [linear(x, w) for w, _, x in p]),
            best_of(lambda p=pairs: [cg.gemm_q8(x, q, None) for _, q, x in p]),
            best_of(lambda p=pairs: [linear(x, q.dequantize()) for _, q, x in p]),
        ]
        print(f"| {m} | " + " | ".join(f"{1e3 * c:.1f} ms" for c in cells) + " |", flush=True)


def one_weight() -> None:
    w = torch.randn(131072, 1024)
    q, x = cg.quantize_q8(w), torch.randn(1, 1024)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        f32 = best_of(lambda: cg.gemm_f32(x, w, None), 5)
        q8 = best_of(lambda: cg.gemm_q8(x, q, None), 5)
        print(
            f"threads {threads}: fp32 {1e3 * f32:.1f} ms ({w.numel() * 4 / f32 / 1e9:.1f} GB/s), "
            f"q8 {1e3 * q8:.1f} ms ({q.nbytes / q8 / 1e9:.1f} GB/s, "
            f"{w.numel() / q8 / 1e9:.1f} G weights/s)"
        )


class _Layer:
    """The few fields a linear method reads of its layer."""

    def __init__(self, w: torch.Tensor) -> None:
        self.weight, self.blocked, self.q8, self.q4 = w, None, cg.quantize_q8(w), None


Fn = Callable[[torch.Tensor, _Layer], torch.Tensor]


def pass_seconds(fn: Fn, x: torch.Tensor, layers: list[_Layer]) -> float:
    """The calling thread's CPU time for `fn(x, layer)` over every layer (one pass)."""
    t0 = time.thread_time()
    for ly in layers:
        fn(x, ly)
    return time.thread_time() - t0


def crossover_variants(w: torch.Tensor) -> dict[str, Fn]:
    torch_m = cpu_float_method(w, prepack=False)
    return {
        "tile": lambda x, ly: cg.gemm_f32(x, ly.weight, None),
        "torch": lambda x, ly: torch_m.apply(ly, x, None),
        "q8": lambda x, ly: cg.gemm_q8(x, ly.q8, None),
    }


def crossover(rows: list[int], rounds: int) -> None:
    """Per LFM2-350M shape and row count: our fp32 tile, torch's linear as the engine binds it
    with cpu_kernels off (oneDNN from 1M weights, F.linear below) and our q8 tile. One thread,
    the thread's CPU time per weight (a loaded machine's wall time means nothing), best of
    `rounds` rounds, each round alternating the variants. Ratio > 1: ours is faster."""
    print("| shape | rows | fp32 tile | torch fp32 | q8 tile | torch / tile | torch / q8 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape, (n, k) in LFM2_350M_SHAPES.items():
        g = torch.Generator().manual_seed(n + k)
        copies = max(1, PASS_BYTES // (n * k * 4))
        layers = [_Layer(torch.randn(n, k, generator=g)) for _ in range(copies)]
        fns = crossover_variants(layers[0].weight)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            t = {v: float("inf") for v in fns}
            for _ in range(rounds):
                for v, fn in fns.items():
                    t[v] = min(t[v], pass_seconds(fn, x, layers))
            ms = " | ".join(f"{1e3 * t[v] / copies:.3f} ms" for v in fns)
            print(
                f"| {shape} | {m} | {ms} | {t['torch'] / t['tile']:.2f}x | "
                f"{t['torch'] / t['q8']:.2f}x |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", action="store_true")
    ap.add_argument("--crossover", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    why = cg.load()
    if why is not None:
        raise SystemExit(f"the AVX2 kernels are unavailable: {why}")
    torch.set_num_threads(1 if args.crossover else args.threads)
    if args.one:
        one_weight()
    elif args.crossover:
        rows = "1,2,4,8,16,32,64,512" if args.rows == ROWS else args.rows
        crossover([int(r) for r in rows.split(",")], args.rounds)
    else:
        per_weight([int(r) for r in args.rows.split(",")])


if __name__ == "__main__":
    main()
