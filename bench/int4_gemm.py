"""torch's CPU int4 linears against our fp32 and q8 kernels, per LFM2-350M weight shape.

    .venv/bin/python bench/int4_gemm.py                 # 1, 8, 32 rows, 2 threads
    .venv/bin/python bench/int4_gemm.py --rows 1 --groups 32

Measures before writing a kernel: `_weight_int4pack_mm_for_cpu` (4-bit weights, a scale and a
float zero per group of 32/64/128, fp32 activations) and `_dyn_quant_matmul_4bit` (int8
activations; its fast path is ARM's KleidiAI, elsewhere a reference) against our AVX2 fp32
kernel, oneDNN fp32 and our q8 kernel. Each cell is the best of `--runs` passes over all the
weights (LFM2-350M's MLP and conv projections: past the caches); ratios are speed-ups over our
q8 kernel (the bar int4 has to beat at one row): our q4 kernel (kernels/cpu_gemm_q4.inc) and
torch's at g32. On a loaded machine `--threads 1 --clock cpu` compares CPU time instead.
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
from shortconv.layers.linear_float import dense_linear  # noqa: E402

# LFM2-350M: MLP w1/w3 (4608 x 1024) and w2 (1024 x 4608), conv in_proj (3072 x 1024).
SHAPES = [(4608, 1024)] * 4 + [(1024, 4608)] * 2 + [(3072, 1024)] * 2


RUNS = [5]  # passes per cell (--runs)
CLOCK = [time.perf_counter]  # --clock cpu: this thread's CPU time (with --threads 1)


def best_of(fn: Callable[[], object]) -> float:
    fn()
    runs = RUNS[0]
    best = float("inf")
    for _ in range(runs):
        t0 = CLOCK[0]()
        fn()
        best = min(best, CLOCK[0]() - t0)
    return best


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def pack_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tinygemm layout: 4-bit codes (w ~= (q - 8) * scale + zero) and [K/g, N, 2]."""
    n, k = w.shape
    b = w.view(n, k // group, group)
    lo, hi = b.amin(-1), b.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((b - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(n, k), 1)
    zeros = lo + 8 * scale
    return packed, torch.stack([scale, zeros], -1).transpose(0, 1).contiguous()


def pack_dyn(w: torch.Tensor, group: int) -> torch.Tensor | None:
    n, k = w.shape
    b = w.view(n, k // group, group)
    scale = (b.abs().amax(-1) / 7).clamp_min(1e-12)
    q = (torch.round(b / scale.unsqueeze(-1)).clamp(-8, 7) + 8).to(torch.uint8).view(n, k)
    try:
        return torch.ops.aten._dyn_quant_pack_4bit_weight(q, scale, torch.zeros(n), group, k, n)
    except RuntimeError:
        return None


def row(m: int, ws: list[torch.Tensor], groups: list[int], with_dyn: bool) -> list[float]:
    xs = [torch.randn(m, w.shape[1]) for w in ws]
    qs = [cg.quantize_q8(w) for w in ws]
    q4s = [quantize_q4(w) for w in ws]
    cells = [
        best_of(lambda: [cg.gemm_f32(x, w, None) for x, w in zip(xs, ws, strict=True)]),
        best_of(lambda: [dense_linear(x, w) for x, w in zip(xs, ws, strict=True)]),
        best_of(lambda: [cg.gemm_q8(x, q, None) for x, q in zip(xs, qs, strict=True)]),
        best_of(lambda: [gemm_q4(x, q, None) for x, q in zip(xs, q4s, strict=True)]),
    ]
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    for g in groups:
        ps = [pack_int4(w, g) for w in ws]
        pairs = list(zip(xs, ps, strict=True))
        cells.append(best_of(lambda g=g, pairs=pairs: [mm(x, p, g, sz) for x, (p, sz) in pairs]))
    if with_dyn:
        dyn = torch.ops.aten._dyn_quant_matmul_4bit
        ds = [pack_dyn(w, 32) for w in ws]
        fn = [(x, d, w.shape) for x, d, w in zip(xs, ds, ws, strict=True)]
        try:
            cells.append(best_of(lambda: [dyn(x, d, 32, s[1], s[0]) for x, d, s in fn]))
        except (RuntimeError, TypeError) as exc:  # no x86 path in this build
            print(f"_dyn_quant_matmul_4bit does not run here: {exc}")
            cells.append(float("nan"))
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--groups", default="32,64,128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-dyn", action="store_true")
    ap.add_argument("--runs", type=int, default=5, help="passes per cell, best taken")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the calling thread's CPU time, for a loaded machine (needs --threads 1)",
    )
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu counts one thread's time: use --threads 1")
    RUNS[0] = args.runs
    CLOCK[0] = time.thread_time if args.clock == "cpu" else time.perf_counter
    if (why := cg.load()) is not None:
        raise SystemExit(f"the AVX2 kernels are unavailable: {why}")
    torch.set_num_threads(args.threads)
    groups = [int(g) for g in args.groups.split(",")]
    ws = [torch.randn(n, k) for n, k in SHAPES]
    load = open("/proc/loadavg").read().split()[0]
    print(f"CPU: {cpu_model()}, {args.threads} threads, {args.clock} clock, load {load}")
    heads = ["fp32 ours", "fp32 oneDNN", "q8 ours", "q4 ours"] + [f"int4 g{g}" for g in groups]
    heads += [] if args.no_dyn else ["dyn4 g32"]
    print("| rows | " + " | ".join(heads) + " | q4 ours / q8 | torch int4 g32 / q8 |")
    print("| --- " * (len(heads) + 3) + "|")
    for m in (int(r) for r in args.rows.split(",")):
        cells = row(m, ws, groups, not args.no_dyn)
        ms = " | ".join(f"{1e3 * c:.2f} ms" for c in cells)
        torch4 = cells[2] / cells[4 + groups.index(32)] if 32 in groups else float("nan")
        print(f"| {m} | {ms} | {cells[2] / cells[3]:.2f}x | {torch4:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
