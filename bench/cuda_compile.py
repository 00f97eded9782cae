"""Compile every Triton kernel for an H200 (sm_90) on CPU, at the engine's launch configurations.

    PYTHONPATH=. python bench/cuda_compile.py            # full sweep (every model, tp, dtype)
    PYTHONPATH=. python bench/cuda_compile.py --quick    # one configuration per kernel and dtype
    PYTHONPATH=. python bench/cuda_compile.py --summary  # plus a per-kernel table (RESULTS.md)

Every kernel is compiled through its real wrapper on `meta` tensors (bench/sm90_harness.py),
for every published model shape, tp size, decode batch bucket, prefill chunk and dtype
(bench/compile_cases.py). One line per kernel and configuration: shared memory, registers,
spill bytes (stores + loads, per thread), stack frame, and whether the code uses tensor-core
instructions. Exit status 1 on any compile failure, or on spills in a bf16/fp16 configuration
(fp32 spills are reported, not failed: exact fp32 products run on FMA units, not tensor cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compile_cases as cc  # noqa: E402
from sm90_harness import CompileRecord, compile_only_sm90, run_launch  # noqa: E402

DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# NOTE: --quick (the test suite's subset): each family at the rank shapes with the widest tiles
# (ZAYA1's head_dim 128) and the launch classes no other shape has: LFM3's width-7 short conv
# and its sliding-window attention (head_dim 128, GQA group 4).
QUICK: dict[str, tuple[tuple[str, int], ...]] = {
    "short_conv": (("LFM2-350M", 1), ("LFM3-1.7B", 1)),
    "cca_conv": (("ZAYA1-8B", 1),),
    "attention": (("ZAYA1-8B", 1), ("LFM3-1.7B", 1)),
    "fused_moe": (("ZAYA1-8B", 1),),
    "lora": (("LFM2-350M", 1),),
    "expert_lora": (("ZAYA1-8B", 1),),
}


@dataclass(frozen=True)
class Line:
    family: str
    rank: str
    dtype: torch.dtype
    shape: str
    rec: CompileRecord

    @property
    def bad(self) -> bool:
        """A failure, or a spill where tensor-core dtypes must not spill."""
        return not self.rec.ok or (self.rec.spill > 0 and self.dtype != torch.float32)

    def format(self) -> str:
        r = self.rec
        head = (
            f"{r.kernel:18s} {self.family:10s} {self.rank:16s} {DT[self.dtype]:4s} {self.shape:34s}"
        )
        if not r.ok:
            return f"{head} FAILED {r.error}"
        tc = "tc" if r.tensor_cores else "-"
        return (
            f"{head} warps={r.num_warps} stages={r.num_stages} smem={r.shared} "
            f"regs={r.registers} spill={r.spill} stack={r.stack} {tc}"
            + (" SPILL" if self.bad else "")
        )


def sweep(
    ranks: list[cc.RankShape],
    dtypes: tuple[torch.dtype, ...],
    quick: bool,
    families: dict[str, object] | None = None,
    echo: bool = True,
) -> list[Line]:
    """Compile every family's launches for every rank shape and dtype; one Line per kernel."""
    families = cc.FAMILIES if families is None else families
    lines: list[Line] = []
    with compile_only_sm90() as session:
        for rank in ranks:
            for dtype in dtypes:
                for fam, gen in families.items():
                    for launch in gen(rank, dtype, quick):  # type: ignore[operator]
                        for rec in run_launch(session, launch.call):
                            line = Line(fam, rank.label, dtype, launch.shape, rec)
                            lines.append(line)
                            if echo:
                                print(line.format(), flush=True)
        if echo:
            print(f"# {len(lines)} kernel launches, {session.unique_compiles} unique compiles")
    return lines


def _pick_families(names: list[str]) -> dict[str, object]:
    return {n: cc.FAMILIES[n] for n in names}


def _sweep_rank(model: str, tp: int, families: list[str]) -> list[Line]:
    """One rank shape's full sweep, in a worker process (its own compile session)."""
    fams = _pick_families(families)
    return sweep([cc.rank_shape(model, tp)], cc.DTYPES, False, fams, echo=False)


def parallel_sweep(ranks: list[cc.RankShape], jobs: int, families: list[str]) -> list[Line]:
    """The full sweep over `jobs` processes (compiling is CPU-bound and mostly holds the GIL),
    printed in rank order as each rank's results arrive in order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    lines: list[Line] = []
    ctx = multiprocessing.get_context("spawn")  # NOTE: no fork of a process holding triton
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_sweep_rank, r.model, r.tp, families) for r in ranks]
        for fut in futures:
            for ln in fut.result():
                print(ln.format(), flush=True)
                lines.append(ln)
    return lines


def quick_sweep(echo: bool = True, families: list[str] | None = None) -> list[Line]:
    """One configuration per kernel and dtype (decode at the largest batch bucket, prefill)."""
    lines: list[Line] = []
    for fam, shapes in QUICK.items():
        if families is not None and fam not in families:
            continue
        ranks = [cc.rank_shape(model, tp) for model, tp in shapes]
        lines += sweep(ranks, cc.DTYPES, True, {fam: cc.FAMILIES[fam]}, echo=echo)
    return lines


def failures(lines: list[Line]) -> tuple[list[Line], list[Line]]:
    """(compile failures, bf16/fp16 configurations that spill): either fails the sweep."""
    return [ln for ln in lines if not ln.rec.ok], [ln for ln in lines if ln.bad and ln.rec.ok]


def summary(lines: list[Line]) -> list[str]:
    """Markdown rows per (kernel, dtype): configurations, max registers / spill / stack / smem,
    tensor cores in every configuration, failures."""
    groups: dict[tuple[str, str], list[CompileRecord]] = defaultdict(list)
    for ln in lines:
        groups[(ln.rec.kernel, DT[ln.dtype])].append(ln.rec)
    rows = [
        "| kernel | dtype | configs | warps | max regs | max spill B | max stack B | max smem B "
        "| tensor cores | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (kernel, dt), recs in sorted(groups.items()):
        ok = [r for r in recs if r.ok]
        warps = "/".join(str(w) for w in sorted({r.num_warps for r in ok}))
        tc = (
            "all"
            if ok and all(r.tensor_cores for r in ok)
            else ("some" if any(r.tensor_cores for r in ok) else "none")
        )

        def top(attr: str, ok: list[CompileRecord] = ok) -> int:
            return max((getattr(r, attr) for r in ok), default=0)

        rows.append(
            f"| {kernel} | {dt} | {len(recs)} | {warps} | {top('registers')} | {top('spill')} "
            f"| {top('stack')} | {top('shared')} | {tc} | {len(recs) - len(ok)} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one configuration per kernel and dtype")
    p.add_argument("--summary", action="store_true", help="print the per-kernel markdown table")
    p.add_argument("--models", default=",".join(cc.MODELS), help="comma list of model names")
    p.add_argument("--families", default=",".join(cc.FAMILIES), help="comma list of kernels")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    families = [f for f in args.families.split(",") if f]
    if unknown := set(families) - set(cc.FAMILIES):
        p.error(f"unknown kernel families {sorted(unknown)}")
    if args.quick:
        lines = quick_sweep(families=families)
    else:
        ranks = cc.rank_shapes(tuple(m for m in args.models.split(",") if m))
        jobs = min(args.jobs, len(ranks))
        if jobs > 1:
            lines = parallel_sweep(ranks, jobs, families)
        else:
            lines = sweep(ranks, cc.DTYPES, False, _pick_families(families))
    failed, spilled = failures(lines)
    fp32_spill = [ln for ln in lines if ln.rec.ok and ln.rec.spill and ln.dtype == torch.float32]
    if args.summary:
        print("\n".join(summary(lines)))
    print(
        f"SUMMARY cuda_compile target=sm_90 launches={len(lines)} failures={len(failed)} "
        f"bf16_fp16_spills={len(spilled)} fp32_spills={len(fp32_spill)} "
        f"seconds={time.perf_counter() - t0:.0f}"
    )
    return 1 if failed or spilled else 0


if __name__ == "__main__":
    sys.exit(main())
