"""The CUDA build of every Triton kernel, checked on CPU: each kernel compiles for an H200
(sm_90) through its real wrapper (bench/cuda_compile.py's quick subset: one configuration per
kernel and dtype), bf16/fp16 configurations spill nothing, and attention, MoE and CCA products
use tensor-core instructions. A deliberately broken kernel shows the harness fails loudly.

Compiles go to a temporary Triton cache (nothing is cached outside tmp); about 30 s on the
2-core development machine.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
import torch

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import compile_cases as cc  # noqa: E402
import cuda_compile  # noqa: E402
import triton.language as tl  # noqa: E402
from sm90_harness import compile_only_sm90, parse_ptxas_log, run_launch  # noqa: E402

T = TypeVar("T")

# The kernels of each family, and the ones whose products must run on tensor cores.
EXPECTED = {
    "_fn_out_kernel",
    "_fn_state_kernel",
    "_update_kernel",
    "_cca_kernel",
    "decode_kernel",
    "reduce_kernel",
    "extend_kernel",
    "_gate_up_kernel",
    "_down_kernel",
    "_shrink_kernel",
    "_expand_kernel",
}
TENSOR_CORES = {
    "_cca_kernel",
    "decode_kernel",
    "extend_kernel",
    "_gate_up_kernel",
    "_down_kernel",
    "_shrink_kernel",
    "_expand_kernel",
}


def _in_fresh_process(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) in a spawned process without TRITON_INTERPRET.

    NOTE: when TRITON_INTERPRET was set as triton was first imported (`TRITON_INTERPRET=1
    pytest tests/kernels`), triton.language's own @jit helpers (the combine functions the
    attention kernels reduce with) are interpreter objects for the life of the process, and
    the compile path's first import of triton's gluon asserts they are not: compiles must run
    in a process whose triton never saw the interpreter."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            return pool.submit(fn, *args).result()


@pytest.fixture(scope="module")
def quick_lines() -> list[cuda_compile.Line]:
    return _in_fresh_process(cuda_compile.quick_sweep, False)


def test_every_kernel_compiles_for_sm90_in_every_dtype(quick_lines) -> None:  # noqa: ANN001
    failed, _ = cuda_compile.failures(quick_lines)
    assert not failed, "\n".join(ln.format() for ln in failed)
    seen = {(ln.rec.kernel, ln.dtype) for ln in quick_lines}
    assert seen == {(k, dt) for k in EXPECTED for dt in cc.DTYPES}, seen


def test_bf16_and_fp16_spill_nothing_and_use_tensor_cores(quick_lines) -> None:  # noqa: ANN001
    _, spilled = cuda_compile.failures(quick_lines)
    assert not spilled, "\n".join(ln.format() for ln in spilled)
    for ln in quick_lines:
        if ln.dtype != torch.float32 and ln.rec.kernel in TENSOR_CORES:
            assert ln.rec.tensor_cores, ln.format()
        assert ln.rec.num_warps in (4, 8), ln.format()  # chosen on purpose, see launch_config


def _dot_on_8_rows(x_ptr, out_ptr, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202, N803
    # 8-row blocks: an [8, 8] x [8, 8] tl.dot. Tensor-core products need K >= 16, so this
    # does not compile (8 x 16 x 8 would: Triton pads M and N, never K).
    r = tl.arange(0, BLOCK)
    a = tl.load(x_ptr + r[:, None] * BLOCK + r[None, :])
    tl.store(out_ptr + r[:, None] * BLOCK + r[None, :], tl.dot(a, a))


def _broken_family(rank: cc.RankShape, dtype: torch.dtype, quick: bool):  # noqa: ANN202
    def call() -> None:
        x = torch.empty(8, 8, dtype=dtype, device="meta")
        triton.jit(_dot_on_8_rows)[(1,)](x, torch.empty_like(x), BLOCK=8)

    yield cc.Launch("8-row dot", call)


def _broken_sweep() -> list[cuda_compile.Line]:
    rank = cc.rank_shape("LFM2-350M", 1)
    return cuda_compile.sweep([rank], (torch.bfloat16,), True, {"broken": _broken_family}, False)


def test_a_broken_kernel_fails_the_sweep() -> None:
    lines = _in_fresh_process(_broken_sweep)
    failed, _ = cuda_compile.failures(lines)
    assert [ln.rec.kernel for ln in failed] == ["_dot_on_8_rows"], lines
    assert "FAILED" in failed[0].format() and "CompilationError" in failed[0].rec.error


def test_a_wrapper_that_raises_or_launches_nothing_is_a_failure() -> None:
    with compile_only_sm90() as session:
        raised = run_launch(session, lambda: 1 / 0)
        idle = run_launch(session, lambda: None)
    assert [r.ok for r in raised] == [False] and "ZeroDivisionError" in raised[0].error
    assert [r.ok for r in idle] == [False] and "no kernel" in idle[0].error


def test_ptxas_log_parsing() -> None:
    log = (
        "ptxas info    : Function properties for k\n"
        "    8912 bytes stack frame, 38590 bytes spill stores, 42880 bytes spill loads\n"
        "ptxas info    : Used 32 registers, used 1 barriers, 8912 bytes cumulative stack size\n"
    )
    assert parse_ptxas_log(log) == (32, 38590 + 42880, 8912)
    with pytest.raises(ValueError, match="no register"):
        parse_ptxas_log("garbage")


def test_autotune_table_is_off_by_default_and_switches_on(monkeypatch) -> None:  # noqa: ANN001
    from triton.runtime.autotuner import Autotuner

    from shortconv.kernels import attention_triton, cca_triton, launch_config, moe_triton

    # NOTE: not monkeypatch.setattr on the knob: undoing it would pin the knob's value and the
    # TRITON_INTERPRET the later interpreter tests set would be ignored.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(launch_config.AUTOTUNE_ENV, raising=False)
    cfg = launch_config.CCA_PREFILL[True]
    assert launch_config.options(cfg, "_cca_kernel") == {"num_warps": 8, "num_stages": 1}
    assert not isinstance(cca_triton._jitted(False, launch_config.tuning()), Autotuner)
    monkeypatch.setenv(launch_config.AUTOTUNE_ENV, "1")
    assert launch_config.tuning() and launch_config.options(cfg, "_cca_kernel") == {}
    tuned = [
        cca_triton._jitted(False, True),
        *attention_triton._jitted(False, True),
        *moe_triton._jitted(False, True),
    ]
    names = [t.fn.fn.__name__ if isinstance(t, Autotuner) else None for t in tuned]
    assert names == ["_cca_kernel", "decode_kernel", None, "extend_kernel"] + [
        "_gate_up_kernel",
        "_down_kernel",
    ]
    for t, name in zip(tuned, names, strict=True):
        if name is not None:
            want = {(w, s) for w, s in launch_config.AUTOTUNE[name]}
            assert {(c.num_warps, c.num_stages) for c in t.configs} == want
    assert tuned[0].restore_value == ["state_ptr"]  # timing runs must not shift the state
