"""The q8 GEMMs of one LFM2-350M step at 1 row (a decode step) and at k + 1 rows (a verify
step), per layer kind, in one process.

    .venv/bin/python bench/spec_gemm_rows.py --threads 2 --rows 1,5 --rounds 5
    .venv/bin/python bench/spec_gemm_rows.py --threads 1 --cpu-time   # a loaded machine

Each weight shape of the bench model (bench/offline.py's LFM2_350M: 10 conv layers, 6 attention
layers, 16 MLPs, the q8 LM head) is quantized and called through the engine's kernel
(`gemm_q8`, the tile set the CPU's flags choose) at each row count, row counts alternated in
every round; a cell is the fastest round's time (wall, or with `--cpu-time` the calling thread's
CPU time, which on one thread leaves out the time it waited for a core) for the calls a step
makes, each on its own copy of the weight.
What the table leaves out of bench/spec_profile.py's step is the rest (conv, attention, norms,
sampling, Python). Ratios only: the machine is shared.
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

# kind -> (out, in, calls per step) for LFM2-350M (hidden 1024, MLP 4608, 16 heads of 64,
# 8 KV heads, vocab 65,536; conv layers' in_proj is 3 x hidden).
KINDS: dict[str, tuple[int, int, int]] = {
    "conv in_proj": (3072, 1024, 10),
    "conv out_proj": (1024, 1024, 10),
    "attn q": (1024, 1024, 6),
    "attn k, v": (512, 1024, 12),
    "attn out": (1024, 1024, 6),
    "mlp w1, w3": (4608, 1024, 32),
    "mlp w2": (1024, 4608, 16),
    "lm head": (65536, 1024, 1),
}


def measure(
    rows: list[int], rounds: int, clock: Callable[[], float]
) -> dict[tuple[str, int], float]:
    """(kind, rows) -> ms per step: the fastest round's time over the kind's `calls` weights,
    each its own copy, so the weights stream from memory as in a step (a step's 350 MB of
    int8 weights do not stay in cache; one weight called again would)."""
    cells: dict[tuple[str, int], float] = {}
    g = torch.Generator().manual_seed(0)
    for kind, (n, k, calls) in KINDS.items():
        qws = [cg.quantize_q8(torch.randn(n, k, generator=g) * 0.05) for _ in range(calls)]
        xs = {m: torch.randn(m, k, generator=g) for m in rows}
        for _ in range(rounds + 1):  # round 0 warms up
            for m in rows:
                t0 = clock()
                for qw in qws:
                    cg.gemm_q8(xs[m], qw, None)
                t = (clock() - t0) * 1e3
                cells[kind, m] = min(cells.get((kind, m), float("inf")), t)
        del qws
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true", help="the calling thread's CPU time")
    args = ap.parse_args()
    if (why := cg.load()) is not None:
        raise SystemExit(f"the CPU kernels are unavailable: {why}")
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    load0 = open("/proc/loadavg").read().split()[0]
    clock = time.thread_time if args.cpu_time else time.perf_counter
    cells = measure(rows, args.rounds, clock)
    load1 = open("/proc/loadavg").read().split()[0]
    print(f"# q8 tiles {cg.set_isa()}, {args.threads} threads, load {load0} -> {load1}")
    what = "thread CPU" if args.cpu_time else "wall"
    print(f"# ms per step ({what}, fastest round); x: over the first row count")
    print("| kind | " + " | ".join(f"{m} rows | x" for m in rows) + " |")
    print("| --- " * (1 + 2 * len(rows)) + "|")
    for kind in [*KINDS, "total"]:
        got = {
            m: sum(cells[k, m] for k in KINDS) if kind == "total" else cells[kind, m] for m in rows
        }
        line = " | ".join(f"{got[m]:.2f} | {got[m] / got[rows[0]]:.2f}x" for m in rows)
        print(f"| {kind} | {line} |")


if __name__ == "__main__":
    main()
