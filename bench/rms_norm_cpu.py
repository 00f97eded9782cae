"""RMSNorm alone on CPU: torch.rms_norm (the old fp32 path) against our fused kernel
(kernels/cpu_norm.inc), each through RMSNorm's forward as the model calls it.

    .venv/bin/python bench/rms_norm_cpu.py            # 1 row x 1024 and 1 row x 16 heads x 64

One thread, a tight loop; each line is the median of 5 rounds of process CPU time per call,
the two paths interleaved round by round (on a loaded machine only their ratio means much).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shortconv.kernels import cpu_gemm as cg  # noqa: E402
from shortconv.layers.norm import RMSNorm  # noqa: E402

CALLS = 20_000


def _cpu_us(norm: RMSNorm, x: torch.Tensor) -> float:
    t0 = time.process_time()
    for _ in range(CALLS):
        norm(x)
    return (time.process_time() - t0) / CALLS * 1e6


def main() -> None:
    if (why := cg.load()) is not None:
        sys.exit(f"CPU kernels unavailable: {why}")
    torch.set_num_threads(1)
    print(f"isa={cg.set_isa()} threads=1 calls={CALLS}")
    for shape in [(1, 1024), (1, 16, 64)]:
        old, new = RMSNorm(shape[-1], 1e-5), RMSNorm(shape[-1], 1e-5)
        new.bind_kernel(True)
        x = torch.randn(shape)
        times: dict[str, list[float]] = {"torch": [], "ours": []}
        with torch.inference_mode():
            for _ in range(5):
                times["torch"].append(_cpu_us(old, x))
                times["ours"].append(_cpu_us(new, x))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"x={list(shape)} torch_us={med['torch']:.2f} ours_us={med['ours']:.2f} "
            f"speedup={med['torch'] / med['ours']:.1f}x"
        )


if __name__ == "__main__":
    main()
