"""The q8 (and q4) CPU tiles per ISA, in CPU time on one thread, variants alternated in one run.

    .venv/bin/python bench/q8_isa.py                      # rows 1, 8, 32; 5 rounds
    .venv/bin/python bench/q8_isa.py --rows 1 --rounds 9

On a loaded machine wall time means nothing: each cell is the calling thread's CPU time (one
torch thread), the best over `--rounds` rounds, and every round runs every variant in turn, so
a slow stretch of the machine hits them alike. Shapes: LFM2-350M's MLP w1/w3 (4608 x 1024), w2
(1024 x 4608), and the 65536 x 1024 LM head (out x in). Ratios are each format's wider tiles
over its AVX2 tile (speed-ups); "q4 avx512vnni" is q4 with int8 activations, "q8 avx512vnni"
q8's 4-blocks-a-register tile (the same int16 activations).
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
from shortconv.kernels.cpu_gemm_q4 import gemm_q4, quantize_q4  # noqa: E402

SHAPES = {"4608x1024": (4608, 1024), "1024x4608": (1024, 4608), "head 65536x1024": (65536, 1024)}
Fn = Callable[[torch.Tensor], torch.Tensor]


def variants(w: torch.Tensor, isas: list[str]) -> dict[str, Fn]:
    """name -> x -> y, for one weight: each tile set pinned before its call."""
    q8, q4 = cg.quantize_q8(w), quantize_q4(w)
    out: dict[str, Fn] = {}
    for isa in isas:

        def run_q8(x: torch.Tensor, isa: str = isa) -> torch.Tensor:
            cg.set_isa(isa)
            return cg.gemm_q8(x, q8, None)

        def run_q4(x: torch.Tensor, isa: str = isa) -> torch.Tensor:
            cg.set_isa(isa)
            return gemm_q4(x, q4, None)

        out[f"q8 {isa}"] = run_q8  # VNNI: q8's quad tile (cpu_gemm_q8_vnni.inc)
        out[f"q4 {isa}"] = run_q4
    return out


def cpu_seconds(fn: Fn, x: torch.Tensor, reps: int) -> float:
    t0 = time.thread_time()
    for _ in range(reps):
        fn(x)
    return (time.thread_time() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if (why := cg.load()) is not None:
        raise SystemExit(f"the CPU kernels are unavailable: {why}")
    torch.set_num_threads(1)
    order = ["avx2", "avx512", "avx512vnni"]
    isas = order[: order.index(cg.set_isa()) + 1]
    rows = [int(r) for r in args.rows.split(",")]
    model = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    print(f"CPU: {model.split(':', 1)[1].strip()}, 1 thread, CPU time")
    print(f"load average at start: {open('/proc/loadavg').read().split()[0]}")
    cells: dict[tuple[str, int, str], float] = {}
    for shape, (n, k) in SHAPES.items():
        g = torch.Generator().manual_seed(n + k)
        fns = variants(torch.randn(n, k, generator=g), isas)
        xs = {m: torch.randn(m, k, generator=g) for m in rows}
        reps = max(1, 2**22 // (n * k))  # about 4 M weights a sample
        for _ in range(args.rounds):
            for name, fn in fns.items():
                for m in rows:
                    fn(xs[m])  # warm: this weight in the caches it fits in, the tile set pinned
                    t = cpu_seconds(fn, xs[m], reps)
                    key = (shape, m, name)
                    cells[key] = min(cells.get(key, float("inf")), t)
    print(f"load average at end: {open('/proc/loadavg').read().split()[0]}")
    names = list(fns)
    wide = [v for v in names if not v.endswith("avx2")]  # each over its format's AVX2 tile
    ratio_heads = " | ".join(f"{v} / avx2" for v in wide)
    print("| shape | rows | " + " | ".join(names) + f" | {ratio_heads} |")
    print("| --- " * (2 + len(names) + len(wide)) + "|")
    for shape in SHAPES:
        for m in rows:
            ts = {v: cells[shape, m, v] for v in names}
            ms = " | ".join(f"{1e3 * t:.3f} ms" for t in ts.values())
            base = {v: ts[v.split()[0] + " avx2"] for v in wide}
            ratios = " | ".join(f"{base[v] / ts[v]:.2f}x" for v in wide)
            print(f"| {shape} | {m} | {ms} | {ratios} |")
    cg.set_isa(isas[-1])


if __name__ == "__main__":
    main()
