"""bench/spec_serve.py --quick: three `serve run` apps (speculation off, ngram, an early-exit
draft) started one after the other on a tiny LFM2, each loaded at concurrency 1 and 2; every
request completes (no errors) and the table has a row per app and concurrency."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_spec_serve_quick() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "spec_serve.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a guard against a hang: three Ray starts on a loaded 2-core machine
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUMMARY spec_serve off@1 off@2 ngram@1 ngram@2 draft_model@1 draft_model@2" in (
        proc.stdout
    ), proc.stdout
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("| off", "| ngram", "| draft"))]
    assert len(rows) == 6 and all(ln.endswith("| 0 |") for ln in rows), proc.stdout
    assert "#   error:" not in proc.stdout, proc.stdout
