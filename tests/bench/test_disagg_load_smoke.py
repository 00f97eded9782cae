"""bench/disagg_load.py --quick: the plain and the disaggregated app started one after the
other on a tiny LFM2, each measured for TTFT and for inter-token latency under long prompts;
every request completes, long prompts arrived during the streams, and only the disaggregated
app handed prompts off (so its row measures the split, not the plain path twice)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def row(stdout: str, app: str) -> list[str]:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith(f"| {app} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_disagg_load_quick() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "disagg_load.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a guard against a hang: two Ray starts on a loaded 2-core machine
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "SUMMARY disagg_load together disaggregated" in proc.stdout, out
    together, split = row(proc.stdout, "together"), row(proc.stdout, "disaggregated")
    # columns: app, TTFT, ratio, ITL p50, ITL p99, ratio, long prompts, handoffs, errors
    for cells in (together, split):
        assert cells[-1] == "0" and int(cells[6]) >= 1, out
        assert float(cells[1]) > 0, out
    assert together[7] == "0" and int(split[7]) >= 3, out  # >= the TTFT requests
    assert "#   error:" not in proc.stdout, out
