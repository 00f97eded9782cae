"""CPU linears for decode batches (AVX2 + FMA, with AVX-512 twins taken at load where the CPU
has them: `set_isa`): fp32 weights, and q8 weights (int8, one fp32 scale per 32 weights of a
row; activations rounded to int16 per 32 values, ~3e-5 of each block's largest magnitude, so
the products sum exactly in int32).

The loops are C++ (`cpu_gemm.cpp`, beside this file), built once per source and torch version
with the system's C++ compiler into the user's cache, and loaded as torch ops
(`torch.ops.shortconv_cpu.gemm_f32` / `gemm_q8`). `load()` builds or finds the library and says
why when it cannot (no AVX2, no compiler, a failed build); callers then keep torch's own paths.
It runs once at start-up (the runner's "cpu kernels" phase), never on the hot path.

`gemm_f32_ref` and `gemm_q8_ref` are the oracles: float64 sums of the same values.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

Q8_BLOCK = 32  # weights per scale
SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
# Sources the build reads (cpu_gemm.cpp includes the q4 kernel, the AVX-512 fp32, q8 and q4
# tiles and the fused RMSNorm): all of them key the cache.
SOURCES = (SOURCE, SOURCE.with_name("cpu_norm.inc")) + tuple(
    SOURCE.with_name(f"cpu_gemm_{part}.inc")
    for part in ("q4", "f32_512", "q8_512", "q8_vnni", "q4_512", "q4_vnni", "q6")
)
_LOCK = threading.Lock()
_STATE: dict[str, str | None] = {}  # "error": why the kernels are unavailable, None once loaded


@dataclass(frozen=True)
class Q8Weight:
    """A linear weight [out, in] as int8 `q` with one fp32 `scale` per 32 weights of a row
    (`scale` [out, in / 32]); w ~= q * scale. The only copy a quantized layer keeps."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] the integers stand for."""
        rows, cols = self.q.shape
        w = self.q.view(rows, cols // Q8_BLOCK, Q8_BLOCK).float() * self.scale.unsqueeze(-1)
        return w.view(rows, cols)


def _round_blocks(x: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] in blocks of 32 along C, each rounded to integers in [-qmax, qmax] with its own
    fp32 scale (largest magnitude / qmax; an all-zero block keeps scale 0 and zeros): the
    rounded values [R, C/32, 32] (as floats) and the scales [R, C/32]."""
    rows, cols = x.shape
    blocks = x.detach().float().reshape(rows, cols // Q8_BLOCK, Q8_BLOCK)
    scale = blocks.abs().amax(dim=-1) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(blocks / safe.unsqueeze(-1)), scale


def quantize_q8(weight: torch.Tensor) -> Q8Weight:
    """Round `weight` [out, in] (in divisible by 32) to int8, one scale per 32 weights: each
    block's largest magnitude maps to 127."""
    rows, cols = weight.shape
    if cols % Q8_BLOCK:
        raise ValueError(f"q8 needs in_features divisible by {Q8_BLOCK}, got {cols}")
    q, scale = _round_blocks(weight, 127.0)
    return Q8Weight(q.to(torch.int8).reshape(rows, cols).contiguous(), scale.contiguous())


def gemm_f32_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y + bias.double() if bias is not None else y).float()


def quantize_x16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's rounding of x [M, K]: int16 values (as int64) and one fp32 scale per 32
    (largest magnitude / 32767), computed in fp32 as the kernel does."""
    q, scale = _round_blocks(x, 32767.0)
    return q.to(torch.int64), scale


def quantize_x8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with int8 values (largest magnitude / 127): the q4 kernel's rounding of x on
    AVX-512 VNNI CPUs."""
    q, scale = _round_blocks(x, 127.0)
    return q.to(torch.int64), scale


def gemm_q8_ref(x: torch.Tensor, qw: Q8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """Exact block sums of the same integers (int64), then both scales in float64."""
    xq, xs = quantize_x16(x)  # [M, B, 32], [M, B]
    wq = qw.q.to(torch.int64).view(qw.out_features, -1, Q8_BLOCK)  # [N, B, 32]
    sums = torch.einsum("mbk,nbk->mnb", xq, wq).double()  # exact: |sum| < 2^27
    y = (sums * xs.double().unsqueeze(1) * qw.scale.double().unsqueeze(0)).sum(-1)
    return (y + bias.double() if bias is not None else y).float()


def gemm_f32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.shortconv_cpu.gemm_f32(x, w, bias)


def gemm_q8(x: torch.Tensor, qw: Q8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.shortconv_cpu.gemm_q8(x, qw.q, qw.scale, bias)


def set_isa(want: str = "") -> str:
    """The fp32, q8 and q4 tiles in use: "avx2", "avx512" (AVX-512F and BW) or "avx512vnni"
    (the same fp32 tiles; q8 with vpdpwssd, 4 blocks a register; q4 with int8 activations), the
    widest the CPU has, chosen when the library
    loads unless `SHORTCONV_CPU_GEMM_ISA` names one; `want` pins one for this process (tests
    and benchmarks compare them)."""
    return str(torch.ops.shortconv_cpu.set_isa(want))


def cpu_flags() -> frozenset[str]:
    """Linux x86: the CPU's flags in /proc/cpuinfo (empty elsewhere)."""
    try:
        line = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[-1].split())


def cpu_has_avx2_fma() -> bool:
    """AVX2 and FMA, and F16C (q4's fp16 scales; every AVX2 CPU has it): the build targets
    exactly these."""
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def cpu_isa() -> str:
    """The widest tile set this CPU's flags allow, as `set_isa` names it: AVX-512 needs F and BW
    (fp32: F; q8 and q4: BW), "avx512vnni" VNNI too (the library's load-time choice follows
    the same flags)."""
    flags = cpu_flags()
    if not {"avx512f", "avx512bw"} <= flags:
        return "avx2"
    return "avx512vnni" if "avx512_vnni" in flags else "avx512"


def cache_root() -> Path:
    """The per-user cache of the engine's derived files (these kernels' builds, and the
    tokenizers of shortconv/engine/tokenizer_cache.py): `$SHORTCONV_CACHE`, else
    `$XDG_CACHE_HOME/shortconv`, else `~/.cache/shortconv`. Everything under it is keyed by
    what it is derived from, so deleting it only costs the next start a rebuild."""
    root = os.environ.get("SHORTCONV_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shortconv"
    )
    return Path(root)


def cache_dir() -> Path:
    return cache_root() / "kernels"


# NOTE: -fopenmp, or ATen's parallel_for compiles to a serial loop; libgomp resolves at run time
# to the copy torch already loaded (same soname), so there is one thread pool.
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++20", "-shared", "-fPIC")


def library_path() -> Path:
    """Where the build for this source, flags, torch and Python lives (any change rebuilds)."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES))
    key.update(f"{FLAGS} {torch.__version__} {sys.version_info[:2]}".encode())
    return cache_dir() / f"shortconv_cpu_gemm-{key.hexdigest()[:16]}.so"


def _build(out: Path) -> None:
    from torch.utils import cpp_extension

    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: a concurrent start (TP ranks, replicas) never
    # loads a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, abi, *includes]
    cmd += [str(SOURCE), "-o", tmp, *libs, "-lc10", "-ltorch_cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd[:2])} ... failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, out)


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def cannot_build() -> str | None:
    """Why `load()` would fail for sure (cheap: no build), or None where it should work."""
    if os.environ.get("SHORTCONV_CPU_GEMM", "1") == "0":
        return "turned off (SHORTCONV_CPU_GEMM=0)"
    if not cpu_has_avx2_fma():
        return "this CPU lacks AVX2/FMA/F16C"
    if _compiler() is None and not library_path().is_file():
        return "no C++ compiler (c++ or g++) on PATH to build them"
    return None


def load() -> str | None:
    """Build (first time) and load the kernels; None when they are ready, else why not."""
    with _LOCK:
        if "error" in _STATE:
            return _STATE["error"]
        error = cannot_build()
        if error is None:
            path = library_path()
            try:
                if not path.is_file():
                    log.info("building the CPU GEMM kernels into %s (once)", path)
                    _build(path)
                torch.ops.load_library(str(path))
                # An operator's pin (and the benchmarks' A/B): the AVX2 tiles on an AVX-512 CPU.
                set_isa(os.environ.get("SHORTCONV_CPU_GEMM_ISA", ""))
            except (RuntimeError, OSError) as exc:
                error = f"build or load failed: {exc}"
        if error is not None:
            log.warning("CPU GEMM kernels unavailable, torch's paths are used: %s", error)
        _STATE["error"] = error
        return error


def loaded() -> bool:
    """True once `load()` succeeded in this process."""
    return _STATE.get("error", "not loaded") is None
