"""Running a probe script in a fresh interpreter at the repository root (what a process
imports can only be seen in one that has imported nothing yet)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_probe(code: str, *argv: str, env: dict[str, str] | None = None) -> str:
    """The probe's stdout; fails the test (with its stderr's tail) when it exits non-zero."""
    out = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
