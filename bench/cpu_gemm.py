"""The AVX2 linears (shortconv/kernels/cpu_gemm.cpp) against torch's paths, per weight.

    .venv/bin/python bench/cpu_gemm.py            # fp32 and q8 against oneDNN, 1..256 rows
    .venv/bin/python bench/cpu_gemm.py --one      # one 131072 x 1024 weight, 1 and 2 threads

Weights are LFM2-350M's MLP shapes (8 of 4608 x 1024, 4 of 1024 x 4608: 302 MB of fp32, past
the caches); each line is the best of 3 passes over all of them. "q8 widened" is the weight
widened to fp32 per call, then oneDNN (what the kernel's q8 path saves).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shortconv.kernels import cpu_gemm as cg  # noqa: E402
from shortconv.layers.linear_float import dense_linear as linear  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", action="store_true")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    why = cg.load()
    if why is not None:
        raise SystemExit(f"the AVX2 kernels are unavailable: {why}")
    torch.set_num_threads(args.threads)
    if args.one:
        one_weight()
    else:
        per_weight([int(r) for r in args.rows.split(",")])


if __name__ == "__main__":
    main()
