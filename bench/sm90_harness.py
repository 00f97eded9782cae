"""Compile the Triton kernels for an H200 (sm_90) on a machine without a GPU, through their real
wrappers.

Triton 3.6 ships ptxas, so a cubin for sm_90 needs no device; what needs one is the launch
path: `JITFunction.run` asks the active driver for the current target, device and stream, then
compiles and launches. `compile_only_sm90()` installs a stand-in driver that reports an sm_90
device, and a `jit_cache_hook` that compiles each launch's specialisation itself with
`triton.compile(..., target=GPUTarget("cuda", 90, 32))` and then answers "handled", so `run`
returns before any launch. The wrappers are called on `meta` tensors: every shape, stride,
dtype and host-side choice (block sizes, num_warps, grids) is the real one, and no data exists.

Each compiled specialisation becomes a `CompileRecord`: registers, spill bytes and stack frame
from ptxas' own `-v` log, shared memory from the compiled metadata, and whether the PTX uses
tensor-core instructions (`mma` / `wgmma`). Identical specialisations compile once per session
(the Triton cache dir is a fresh temporary one, so nothing is cached outside tmp and every
compile prints its ptxas log).
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

H200 = GPUTarget("cuda", 90, 32)
# NOTE: the option names `JITFunction._call_hook` hands the hook, i.e. the launch's options
# that a compile needs (num_warps / num_stages as the wrapper chose them).
_OPTION_KEYS = (
    "num_warps",
    "num_ctas",
    "num_stages",
    "enable_fp_fusion",
    "launch_cooperative_grid",
    "extern_libs",
)
_TC = re.compile(r"\b(?:wgmma|mma)\.")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class CompileRecord:
    """One compiled specialisation of one kernel (or its failure)."""

    kernel: str
    num_warps: int = 0
    num_stages: int = 0
    shared: int = 0
    registers: int = 0
    spill: int = 0  # spill stores + spill loads, bytes per thread
    stack: int = 0
    tensor_cores: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


class _StandInDriver:
    """The calls `JITFunction.run` makes on the driver before compiling, answered for sm_90."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")

    def is_active(self) -> bool:
        return True


def parse_ptxas_log(log: str) -> tuple[int, int, int]:
    """(registers, spill bytes, stack bytes) from ptxas -v output (one entry function)."""
    regs = _REGS.search(log)
    spill = _SPILL.search(log)
    if regs is None or spill is None:
        raise ValueError(f"no register / spill line in the ptxas log:\n{log}")
    stack, stores, loads = (int(g) for g in spill.groups())
    return int(regs.group(1)), stores + loads, stack


def _one_line(exc: BaseException) -> str:
    """The exception's type, first and last lines (a CompilationError puts the source
    location first and the cause last)."""
    lines = [ln.strip() for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return text[:300]


def compile_one(jit_fn: Any, compile_kwargs: dict[str, Any], target: GPUTarget) -> CompileRecord:
    """Compile one launch's specialisation for `target`; never raises (errors are recorded)."""
    from triton.compiler import ASTSource

    name = jit_fn.fn.__name__
    opts = {k: compile_kwargs[k] for k in _OPTION_KEYS}
    src = ASTSource(
        jit_fn,
        compile_kwargs["signature"],
        compile_kwargs["constants"],
        compile_kwargs["configs"][0],
    )
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=target, options=opts)
        regs, spill, stack = parse_ptxas_log(log.getvalue())
    except Exception as exc:  # noqa: BLE001 - a failed compile is a result, not a crash
        return CompileRecord(name, opts["num_warps"], opts["num_stages"], error=_one_line(exc))
    return CompileRecord(
        kernel=name,
        num_warps=opts["num_warps"],
        num_stages=opts["num_stages"],
        shared=int(kernel.metadata.shared),
        registers=regs,
        spill=spill,
        stack=stack,
        tensor_cores=bool(_TC.search(kernel.asm["ptx"])),
    )


@dataclass
class CompileSession:
    """What `compile_only_sm90` recorded: every launch since the last `take()`."""

    target: GPUTarget
    launched: list[CompileRecord] = field(default_factory=list)
    _seen: dict[tuple[str, str], CompileRecord] = field(default_factory=dict)

    def hook(self, *, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        cache_key = (fn.name, repr(key))
        rec = self._seen.get(cache_key)
        if rec is None:
            rec = self._seen[cache_key] = compile_one(fn.jit_function, compile, self.target)
        self.launched.append(rec)
        return True  # handled: JITFunction.run returns before launching

    def take(self) -> list[CompileRecord]:
        out, self.launched = self.launched, []
        return out

    @property
    def unique_compiles(self) -> int:
        return len(self._seen)


@contextlib.contextmanager
def compile_only_sm90(target: GPUTarget = H200) -> Iterator[CompileSession]:
    """Within the block, every compiled-mode Triton launch compiles for `target` and records
    itself instead of running. Restores the driver and knobs afterwards."""
    session = CompileSession(target)
    saved_driver = driver._active  # NOTE: reset_active() would build the real (absent) driver
    with (
        tempfile.TemporaryDirectory(prefix="sm90-compile-") as tmp,
        knobs.runtime.scope(),
        knobs.nvidia.scope(),
        knobs.cache.scope(),
    ):
        driver.set_active(_StandInDriver(target))
        knobs.runtime.jit_cache_hook = session.hook
        knobs.runtime.interpret = False  # the wrappers pick their compiled kernels
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v goes to stdout, captured per compile
        knobs.cache.dir = tmp
        try:
            yield session
        finally:
            driver._active = saved_driver


def run_launch(session: CompileSession, call: Callable[[], object]) -> list[CompileRecord]:
    """Run one wrapper call under the session: its kernels' records, or one failure record
    when the wrapper itself raised before (or while) launching."""
    session.take()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
        return [*session.take(), CompileRecord("<wrapper>", error=_one_line(exc))]
    recs = session.take()
    return recs or [CompileRecord("<wrapper>", error="the wrapper launched no kernel")]
