"""Launch settings (block sizes, num_warps, num_stages) of the Triton kernels, per shape class.

Each wrapper takes its settings from here instead of Triton's defaults (4 warps, 3 stages), and
every choice says why: the numbers come from the sm_90 compile report
(`bench/cuda_compile.py`: registers, spills, shared memory, tensor-core use at the engine's
launch configurations), not from timings, since no GPU has run them yet. `CANDIDATES` lists
the alternatives to time when one is lent (`bench/cuda_compile.py` compiles them all);
`SHORTCONV_AUTOTUNE=1` makes the wrappers that support it time those candidates at first use
(triton.autotune), off by default so that graph capture and the tests see one fixed kernel.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

AUTOTUNE_ENV = "SHORTCONV_AUTOTUNE"


class GridKernel(Protocol):
    """A jitted (or autotuned) Triton kernel as the wrappers use it: `kernel[grid](*args)`.
    Triton ships no type hints, so this is the one shape of it the type checker sees."""

    def __getitem__(self, grid: Any) -> Callable[..., Any]: ...


# The widest short conv the Triton kernels take (LFM2: 3, LFM3: 7). Every conv kernel is generic
# in WIDTH (taps unrolled with static_range, state columns in a power-of-2 block), so the bound
# only keeps widths inside what the tests and the sm_90 compile check cover (2..8). Here, not in
# conv1d_triton, so that start-up checks can read it without importing triton.
MAX_CONV_WIDTH = 8


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch options of one kernel for one shape class."""

    block_n: int
    block_i: int = 0  # the reduction chunk (CCA input channels), where a kernel has one
    num_warps: int = 4
    num_stages: int = 1


def autotune_enabled() -> bool:
    """Whether SHORTCONV_AUTOTUNE asks for timed candidates (read per call, like dispatch)."""
    return os.environ.get(AUTOTUNE_ENV, "").strip() == "1"


# CCA conv (`cca_triton._cca_kernel`), g = head_dim = 128 for ZAYA1. A program holds the head's
# [g, BLOCK_N] fp32 accumulator; stage 1 is rebuilt per BLOCK_I input-channel chunk (a loop, not
# unrolled). sm_90 compile report, ZAYA1-8B tp1 (regs / spill bytes per thread):
#   bf16 prefill  64 tok x 16 ch, 8 warps: 190 / 0, tensor cores (32 ch: 235 / 0; 64 ch at
#                 4 warps: 255 / 2556; the old unrolled 32 tok x 32 ch at 4 warps: 250 / 81470)
#   fp32 prefill  32 tok x 16 ch, 8 warps: 128 / 0 (32 ch: 128 / 80); exact fp32 products run
#                 on FMA units with both operands in registers, hence the narrower chunk
#   decode        16 rows x 16 ch, 4 warps: bf16 128 / 0, fp32 167 / 0 (32 ch: 215 and 254)
# 16 channels per chunk is one mma K step. num_stages 1: each chunk's loads feed the
# elementwise stage 1 before the product, which the software pipeliner cannot overlap; more
# stages only cost shared memory. Decode: one program per head owns its rows' state shift
# (see the kernel), so the column block stays at 16 rows (the smallest tensor-core N).
CCA_PREFILL = {True: LaunchConfig(64, 16, 8, 1), False: LaunchConfig(32, 16, 8, 1)}
CCA_DECODE = {True: LaunchConfig(16, 16, 4, 1), False: LaunchConfig(16, 16, 4, 1)}

# Paged attention, keyed (bf16/fp16?, head_dim > 64?): LFM2 has head_dim 64, ZAYA1 128.
# num_stages 1: the K/V loops are `while` loops (data-dependent bounds), which Triton's
# software pipeliner does not touch; more stages would only reserve shared memory.
# Decode (block_n = positions per step, NOTE: 64 in every entry, `_DECODE_BLOCK_N`): bf16/fp16
# at 4 warps: 80 regs (d64) / 152 (d128), 0 spills, tensor cores. fp32 (exact FMA products):
# 8 warps, 175 regs / 0 spills at d64 and 255 / 424 B at d128 (4 warps: 556 B and 3764 B;
# 32 positions per step at d128 still spills 296 B).
ATTN_DECODE = {
    (True, False): LaunchConfig(64, 0, 4, 1),
    (True, True): LaunchConfig(64, 0, 4, 1),
    (False, False): LaunchConfig(64, 0, 8, 1),
    (False, True): LaunchConfig(64, 0, 8, 1),
}
# Extend (block_n = keys per step, block_i = query rows per program, tokens x group heads):
# bf16/fp16 64 x 64 rows: 124 regs at d64 (4 warps), 132 at d128 with 8 warps (182 at 4),
# 0 spills, tensor cores. fp32: d64 32 x 32 at 8 warps 204 / 0 (64 x 64 at 4 warps: 10.7 KB
# spilled); d128 16 x 16 at 8 warps 208 / 0 (64 x 64 at 4 warps: 82.7 KB spills, 14 KB stack).
# NOTE: block_i <= block_n: with a sliding window, a query block's last row first sees the
# key block_m - 1 after the loop start, which must fall in the first key block.
ATTN_EXTEND = {
    (True, False): LaunchConfig(64, 64, 4, 1),
    (True, True): LaunchConfig(64, 64, 8, 1),
    (False, False): LaunchConfig(32, 32, 8, 1),
    (False, True): LaunchConfig(16, 16, 8, 1),
}
# Split-K reduce: splits per chunk (block_n). 32 x d128 fp32 partials = 32 values per thread
# at 4 warps; the whole-row load of a 256-split row (ZAYA1 batch 1, full context) used 255
# registers and spilled.
ATTN_REDUCE = LaunchConfig(32, 0, 4, 1)

# Fused MoE grouped GEMMs (`moe_triton`): block_n x BLOCK_K 64 x 64 weight tiles, BLOCK_M rows
# from the routes per expert (`block_m_for`). 4 warps, 3 stages: the K loop is a `for` with
# constexpr bounds, so the pipeliner double-buffers its loads; at BLOCK_M 64 the gate+up
# kernel holds 2 fp32 accumulators (64 registers per thread): bf16 123 regs / 0 spills /
# 40 KB shared, tensor cores; fp32 167 / 0 / 80 KB (of 227 KB).
MOE_GEMM = LaunchConfig(64, 64, 4, 3)
# Short conv (`conv1d_triton`): elementwise taps, no products. Prefill [64 ch x 32 tok] tiles
# at 8 warps (4 warps spilled 184 B in fp16: int64 offsets per tap); decode and the state
# write-back are [64-128 ch x W] tiles, 19-24 registers at 4 warps. No loop to pipeline.
# NOTE: the taps are unrolled and every tap's loads issue up front, so prefill registers grow
# with the width (sm_90, dim 2048, bf16 / fp16 / fp32): W=3 64/64/58, LFM3's W=7 132/128/73,
# no spills; W=4 fp16 spills 224 B (no model has W=4). Smaller tiles ([64 x 16], [32 x 32],
# 4 or 16 warps) cut W=7 to ~80 registers but made ptxas cap fp16 at 64 and spill (40-176 B
# at W=6..8), so every width keeps this tile until a GPU timing says fewer registers pay.
CONV_PREFILL = LaunchConfig(32, 64, 8, 1)
CONV_SMALL = LaunchConfig(0, 0, 4, 1)

# The autotune table (SHORTCONV_AUTOTUNE=1, off by default): (num_warps, num_stages) candidates
# around each choice above, timed per autotune key at first use on a GPU. Block sizes stay as
# chosen: the grids and the decode split rounding depend on them. Every candidate must also
# compile without bf16/fp16 spills (check with bench/cuda_compile.py before enabling).
AUTOTUNE: dict[str, tuple[tuple[int, int], ...]] = {
    "_cca_kernel": ((4, 1), (8, 1), (8, 2)),
    "decode_kernel": ((4, 1), (8, 1)),
    "extend_kernel": ((4, 1), (8, 1), (8, 2)),
    "_gate_up_kernel": ((4, 3), (8, 3), (4, 4)),
    "_down_kernel": ((4, 3), (8, 3), (4, 4)),
}


def tuning() -> bool:
    """Autotune on: SHORTCONV_AUTOTUNE=1 and compiled kernels (the interpreter times nothing)."""
    import triton

    return autotune_enabled() and not triton.knobs.runtime.interpret


def jit(fn: Callable[..., None], key: Sequence[str], restore: Sequence[str] = ()) -> GridKernel:
    """triton.jit(fn), inside triton.autotune over AUTOTUNE[fn's name] when `tuning()`.
    `restore`: pointer arguments the kernel updates in place (timing runs it many times)."""
    import triton

    kernel = triton.jit(fn)
    if not tuning() or fn.__name__ not in AUTOTUNE:
        return kernel
    configs = [triton.Config({}, num_warps=w, num_stages=s) for w, s in AUTOTUNE[fn.__name__]]
    return triton.autotune(configs=configs, key=list(key), restore_value=list(restore))(kernel)


def options(cfg: LaunchConfig, kernel: str) -> dict[str, int]:
    """A launch's num_warps / num_stages: none when the autotuner picks them."""
    if tuning() and kernel in AUTOTUNE:
        return {}
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
