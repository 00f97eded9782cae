"""How many rows our fp32 CPU tile serves before torch's own linear takes over, per tile set:
kernel choice by measurement, per machine family (issue 48), read once when the linear
methods are bound.

Why a table measured per CPU family and not a calibration at start-up:
- The two paths round differently (the tile and oneDNN sum in different orders), so the
  threshold decides which tokens a request gets. A threshold timed at each start on a shared,
  loaded machine would move between starts (a wall-time pass over the LFM2-350M shapes swung
  0.6x-4x between neighbouring row counts here) and with it the tokens; a table does not.
- The crossover measured at the same row count for every LFM2-350M weight shape on a machine
  (below), so a key per shape would only repeat the one per tile set.
- It costs no start-up time.

Measured with `bench/cpu_gemm.py --crossover` (one thread, CPU time, every LFM2-350M linear
shape, torch's linear as the engine binds it: oneDNN from 1M weights, F.linear below):
- "avx512" / "avx512vnni" (Intel Xeon model 207, 2026-12-06, after the tile kept its
  accumulators in registers, cpu_gemm_f32_512.inc): the tile is 1.09-2.19x torch at 1-8 rows
  on every shape, 1.31-1.60x at 12, 1.24-1.47x at 16, 1.16-1.28x at 32, 1.01-1.14x at 64
  (before, same run: 0.53-0.66x at 32, 0.42-0.55x at 64): no slower at any count it serves.
- "avx2" (AMD EPYC, 2026-12-03, bench/RESULTS.md): 1.2-1.9x oneDNN at 1-16 rows, 1.1x at 32,
  1.04x at 64 and 128 on the MLP weights; past 64 rows (prefill) oneDNN is kept.
An AVX2-only Intel CPU takes the AVX2 row, unmeasured: oneDNN runs AVX2 code there too.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from shortconv.errors import ConfigError

# fp32 tile set (kernels.cpu_gemm.set_isa's name) -> the most rows a batch may have to take our
# tile; a batch with more goes through torch's linear (the layer's `larger` method).
# NOTE: the threshold cannot drop below prefill sizes: a session resumed from kept state (a
# short suffix: tile) and the same prompt prefilled whole must round alike (the session-store
# and drain tests hold a resumed turn equal to a fresh one in tokens and logprobs; with 8 on
# AVX-512 a logprob came out 1e-4 apart). So the tile must win up to 64 rows, and it does.
MEASURED_TILE_ROWS: Mapping[str, int] = MappingProxyType(
    {"avx2": 64, "avx512": 64, "avx512vnni": 64}
)


def fp32_tile_rows(isa: str, table: Mapping[str, int] = MEASURED_TILE_ROWS) -> int:
    """The row threshold for the fp32 tile set `isa`, from `table` (tests inject their own).
    A tile set the table lacks is refused by name: serving it unmeasured could be slower than
    torch's linear, which the issue forbids."""
    rows = table.get(isa)
    if rows is None:
        raise ConfigError(
            f"no fp32 tile row threshold for tile set {isa!r} (measured: {sorted(table)}); "
            "measure it with bench/cpu_gemm.py --crossover, or serve with cpu_kernels off"
        )
    return rows
