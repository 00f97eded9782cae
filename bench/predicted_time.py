"""Predicted H200 time of each kernel at bench/kernels.py's benchmarked shapes (no GPU needed).

    PYTHONPATH=. python bench/predicted_time.py            # markdown table (bench/RESULTS.md)
    PYTHONPATH=. python bench/predicted_time.py kernels.log  # with the measured column filled

Per launch: the fewest bytes it must move (the byte counts bench/kernels.py divides by, from
the same functions) and the FLOPs of its arithmetic, then the roofline time
max(bytes / 4.8 TB/s, FLOPs / 989 TFLOP/s) of one H200 (HBM3e bandwidth, dense bf16 tensor
cores). The measured column reads bench/kernels.py's output (its per-shape lines) when given,
and stays empty until a GPU has run it.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_cases as kc  # noqa: E402
import kernels  # noqa: E402

H200_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 989e12
BF16 = 2  # bytes per element: the GPU run benchmarks bf16
CONV_WIDTH = 3  # bench/kernels.py's short-conv window


@dataclass(frozen=True)
class Prediction:
    kernel: str  # bench/kernels.py's row name
    shape: str  # and its shape label
    nbytes: float
    flops: float

    @property
    def seconds(self) -> float:
        return max(self.nbytes / H200_BYTES_PER_S, self.flops / H200_BF16_FLOPS)

    @property
    def bound(self) -> str:
        compute = self.flops / H200_BF16_FLOPS >= self.nbytes / H200_BYTES_PER_S
        return "compute" if compute else "memory"


def expected_used_experts(s: kc.MoeShape) -> float:
    """Mean distinct experts over T tokens drawing k distinct of E each (skip routes aside)."""
    return s.experts * (1 - (1 - s.k / s.experts) ** s.tokens)


def predictions() -> list[Prediction]:
    out = []
    for batch, dim in kernels.GPU_UPDATES:
        nbytes = kernels.update_bytes(batch, dim, CONV_WIDTH, BF16)
        out.append(
            Prediction(
                "update_triton", f"B={batch} dim={dim}", nbytes, 2 * batch * dim * CONV_WIDTH
            )
        )
    for seqs, seqlen, dim in kernels.GPU_FNS:
        nbytes = kernels.fn_bytes(seqs, seqlen, dim, CONV_WIDTH, BF16)
        flops = 2 * seqs * seqlen * dim * CONV_WIDTH
        out.append(Prediction("fn_triton", f"seqs={seqs} len={seqlen} dim={dim}", nbytes, flops))
    attn, moe = kc.shapes(quick=False)
    for s in attn:
        nbytes = kc.attention_bytes(s, s.batch * s.context, BF16)
        flops = 4 * s.batch * s.hq * s.context * s.d  # q.k and p.v
        out.append(Prediction("attention_triton", s.label, nbytes, flops))
    for s in moe:
        routes = s.tokens * s.k * (1 - kc.SKIP_FRACTION / s.k if s.skip else 1)
        nbytes = kc.moe_bytes(s, expected_used_experts(s), BF16)
        flops = routes * 6 * s.hidden * s.inter  # gate+up (2 x 2HI) and down (2HI) per route
        out.append(Prediction("moe_triton", s.label + (" +skip" if s.skip else ""), nbytes, flops))
    return out


def measured(log: str) -> dict[tuple[str, str], float]:
    """(kernel, shape) -> microseconds from bench/kernels.py's report lines."""
    found = {}
    for m in re.finditer(r"^(\w+_triton)\s+(.+?)\s+([\d.]+) us\s+[\d.]+ GB/s", log, re.M):
        found[(m.group(1), m.group(2).strip())] = float(m.group(3))
    return found


def table(preds: list[Prediction], seen: dict[tuple[str, str], float]) -> list[str]:
    rows = [
        "| kernel | shape | MB moved | GFLOP | bound | predicted us | measured us |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in preds:
        got = seen.get((p.kernel, p.shape))
        rows.append(
            f"| {p.kernel} | {p.shape} | {p.nbytes / 1e6:.2f} | {p.flops / 1e9:.3f} | {p.bound} "
            f"| {p.seconds * 1e6:.2f} | {'' if got is None else f'{got:.1f}'} |"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", nargs="?", help="bench/kernels.py output from a GPU run")
    args = p.parse_args(argv)
    seen = measured(Path(args.log).read_text()) if args.log else {}
    print("\n".join(table(predictions(), seen)))


if __name__ == "__main__":
    main()
