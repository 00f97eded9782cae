"""The benchmarks run end to end on CPU (`--quick`): tiny sizes, Triton under the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("script", "marker"),
    [
        ("bench/decode_step.py", "SUMMARY decode"),
        ("bench/kernels.py", "SUMMARY kernels"),
        ("bench/spec_decode.py", "SUMMARY spec_decode"),
        ("bench/lora.py", "SUMMARY lora int8"),
        ("bench/state_move.py", "SUMMARY state_move"),
    ],
)
def test_bench_quick(script: str, marker: str) -> None:
    pytest.importorskip("triton")
    # NOTE: a passive OpenMP wait: the default spinning wait made a 2-thread run up to 10x
    # slower beside the suite's other workers on 2 cores (past the limit below, which is a
    # guard against a hang, not a timing: these runs take 3-7 s on a quiet machine).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("TRITON_INTERPRET", None)  # kernels.py --quick sets it itself
    proc = subprocess.run(
        [sys.executable, str(ROOT / script), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker in proc.stdout, proc.stdout
