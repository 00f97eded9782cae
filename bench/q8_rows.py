"""The q8 tile at a few rows (a verify step's k + 1 positions) against the fp32 tile and torch's
fp32 linear, in CPU time on one thread, variants alternated in one run.

    .venv/bin/python bench/q8_rows.py                       # rows 1,2,3,5,8,9,16,32; 5 rounds
    .venv/bin/python bench/q8_rows.py --rows 1,5 --rounds 9

Shapes: LFM2-350M's MLP w1/w3 (4608 x 1024) and w2 (1024 x 4608), out x in. Each cell is the
best over `--rounds` rounds of the calling thread's CPU time per call (a loaded machine's wall
time means nothing); every round runs every variant at every row count in turn. "x1" columns
are the cost over the same variant's first row count (one row by default): what a verify row
of M positions costs against a decode row. The q8 tiles run once per tile set the CPU has
(`set_isa`), so the VNNI quad tile and the AVX-512 pair tile it replaced compare in one run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from q8_isa import cpu_seconds  # noqa: E402

from shortconv.kernels import cpu_gemm as cg  # noqa: E402
from shortconv.layers.linear_float import dense_linear  # noqa: E402

SHAPES = {"4608x1024": (4608, 1024), "1024x4608": (1024, 4608)}
Fn = Callable[[torch.Tensor], torch.Tensor]


def variants(w: torch.Tensor, isas: list[str]) -> dict[str, Fn]:
    """name -> x -> y for one weight: our q8 tiles per tile set this CPU has, our fp32 tile and
    torch's fp32 linear (those two on the widest tile set)."""
    q8 = cg.quantize_q8(w)

    def pinned(fn: Fn, isa: str) -> Fn:
        def run(x: torch.Tensor) -> torch.Tensor:
            cg.set_isa(isa)
            return fn(x)

        return run

    out = {f"q8 {isa}": pinned(lambda x: cg.gemm_q8(x, q8, None), isa) for isa in isas}
    out["fp32 ours"] = pinned(lambda x: cg.gemm_f32(x, w, None), isas[-1])
    out["fp32 torch"] = lambda x: dense_linear(x, w)
    return out


def measure(rows: list[int], rounds: int, isas: list[str]) -> dict[tuple[str, int, str], float]:
    cells: dict[tuple[str, int, str], float] = {}
    for shape, (n, k) in SHAPES.items():
        g = torch.Generator().manual_seed(n + k)
        fns = variants(torch.randn(n, k, generator=g), isas)
        xs = {m: torch.randn(m, k, generator=g) for m in rows}
        reps = max(1, 2**23 // (n * k))
        for _ in range(rounds):
            for name, fn in fns.items():
                for m in rows:
                    fn(xs[m])  # warm
                    key = (shape, m, name)
                    cells[key] = min(cells.get(key, float("inf")), cpu_seconds(fn, xs[m], reps))
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,5,8,9,16,32")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if (why := cg.load()) is not None:
        raise SystemExit(f"the CPU kernels are unavailable: {why}")
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    order = ["avx2", "avx512", "avx512vnni"]
    isas = order[: order.index(cg.set_isa()) + 1]
    model = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    print(f"CPU: {model.split(':', 1)[1].strip()}, 1 thread, CPU time")
    print(f"load average at start: {open('/proc/loadavg').read().split()[0]}")
    cells = measure(rows, args.rounds, isas)
    print(f"load average at end: {open('/proc/loadavg').read().split()[0]}")
    cg.set_isa(isas[-1])
    best = f"q8 {isas[-1]}"
    names = [f"q8 {isa}" for isa in isas] + ["fp32 ours", "fp32 torch"]
    heads = " | ".join(f"{v} | x1" for v in names)
    print(f"| shape | rows | {heads} | {best} / fp32 ours | {best} / fp32 torch |")
    print("| --- " * (4 + 2 * len(names)) + "|")
    for shape in SHAPES:
        for m in rows:
            t = {v: cells[shape, m, v] for v in names}
            one = {v: cells[shape, rows[0], v] for v in names}
            per = " | ".join(f"{1e3 * t[v]:.3f} ms | {t[v] / one[v]:.2f}x" for v in names)
            speed = f"{t['fp32 ours'] / t[best]:.2f}x | {t['fp32 torch'] / t[best]:.2f}x"
            print(f"| {shape} | {m} | {per} | {speed} |")


if __name__ == "__main__":
    main()
