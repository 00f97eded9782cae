"""The LM head's GEMM (LFM2-350M: 65536 x 1024) as q8 and as q6, side by side in one process,
on one thread: CPU time of the calling thread per call (time.thread_time), the best of
`--rounds` alternating rounds, per row count and tile set; with `--threads N` (N > 1), wall
time instead (the head at 2 threads is where memory, not instructions, may set the pace).

    .venv/bin/python bench/q6_head.py [--rows 1,8,32] [--rounds 7] [--threads 1]
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
from shortconv.kernels.cpu_gemm_q6 import gemm_q6, quantize_q6  # noqa: E402

HEAD = (65536, 1024)


def seconds(fn: Callable[..., torch.Tensor], *args: object) -> float:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    fn(*args)
    return clock() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    assert cg.load() is None
    torch.set_num_threads(args.threads)
    w = torch.randn(*HEAD, generator=torch.Generator().manual_seed(0)) * 0.02
    q8, q6 = cg.quantize_q8(w), quantize_q6(w)
    print(f"bytes: q8 {q8.nbytes / 1e6:.1f} MB, q6 {q6.nbytes / 1e6:.1f} MB")
    isas = ["avx2", "avx512", "avx512vnni"]
    for isa in isas[: isas.index(cg.cpu_isa()) + 1]:
        cg.set_isa(isa)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, HEAD[1])
            best = {"q8": float("inf"), "q6": float("inf")}
            for _ in range(args.rounds):
                best["q8"] = min(best["q8"], seconds(cg.gemm_q8, x, q8, None))
                best["q6"] = min(best["q6"], seconds(gemm_q6, x, q6, None))
            print(
                f"{isa:10s} rows {m:3d}: q8 {best['q8'] * 1e3:7.2f} ms  q6 {best['q6'] * 1e3:7.2f}"
                f" ms  q6/q8 {best['q6'] / best['q8']:.2f}x"
            )


if __name__ == "__main__":
    main()
