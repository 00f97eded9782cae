"""The LM head's GEMM (LFM2-350M: 65536 x 1024; `--shape` another, e.g. ffn_down's 1024x4608)
as q8, q6 and q4, side by side in one process,
on one thread: CPU time of the calling thread per call (time.thread_time), the best of
`--rounds` alternating rounds, per row count and tile set; with `--threads N` (N > 1), wall
time instead (the head at 2 threads is where memory, not instructions, may set the pace).

    .venv/bin/python bench/q6_head.py [--rows 1,8,32] [--rounds 7] [--threads 1] [--shape NxK]
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
from shortconv.kernels.cpu_gemm_q4 import Q4Weight, gemm_q4, quantize_q4  # noqa: E402
from shortconv.kernels.cpu_gemm_q6 import Q6Weight, gemm_q6, quantize_q6  # noqa: E402


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
    ap.add_argument("--shape", default="65536x1024", help="out x in")
    args = ap.parse_args()
    assert cg.load() is None
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split("x"))
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    weights: dict[str, cg.Q8Weight | Q6Weight | Q4Weight] = {
        "q8": cg.quantize_q8(w),
        "q6": quantize_q6(w),
        "q4": quantize_q4(w),
    }
    gemms: dict[str, Callable[..., torch.Tensor]] = {"q8": cg.gemm_q8, "q6": gemm_q6, "q4": gemm_q4}
    print(", ".join(f"{f} {qw.nbytes / 1e6:.1f} MB" for f, qw in weights.items()))
    isas = ["avx2", "avx512", "avx512vnni"]
    for isa in isas[: isas.index(cg.cpu_isa()) + 1]:
        cg.set_isa(isa)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            best = dict.fromkeys(gemms, float("inf"))
            for _ in range(args.rounds):
                for f, gemm in gemms.items():
                    best[f] = min(best[f], seconds(gemm, x, weights[f], None))
            ms = "  ".join(f"{f} {t * 1e3:7.3f} ms" for f, t in best.items())
            print(f"{isa:10s} rows {m:3d}: {ms}  q6/q8 {best['q6'] / best['q8']:.2f}x")


if __name__ == "__main__":
    main()
