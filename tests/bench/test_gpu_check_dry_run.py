"""`bash bench/gpu_check.sh --dry-run` on CPU: every stage imports what its GPU run imports and
parses its arguments, with ray, pydantic, fastapi and prometheus_client hidden (the GPU machine
has none of them), and each stage reports.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("env", "warmup", "tests", "kernels", "decode", "offline")


def test_dry_run_every_stage_reports(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils timeout")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env["COMPILE_ARGS"] = "--quick --families short_conv"  # the full sweep takes many minutes
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = (tmp_path / "summary.md").read_text()
    for stage in STAGES:
        assert f"- **{stage}**: ok in" in summary, (stage, summary)
    for stage in ("env", "tests", "kernels", "decode", "offline"):
        assert f"DRYRUN {stage} ok" in summary, (stage, summary)
    assert summary.count("DRYRUN") >= 7, summary  # the warm-up's kernels and decode too
    assert "- **compile**: ok in" in summary and "SUMMARY cuda_compile" in summary, summary
    env_log = (tmp_path / "env.log").read_text()
    assert "ray absent" in env_log and "pydantic absent" in env_log, env_log
    assert "plain runner" in (tmp_path / "tests.log").read_text()  # the no-pytest path too
    assert "## Targets" in summary and "dry run" in out


def test_engine_generates_with_the_serve_packages_hidden() -> None:
    """Beyond imports: a tp_size=1 engine run (load, prefill, decode, sessions) on CPU with the
    same packages hidden, so a lazy import at run time cannot surprise the GPU machine either."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'bench' / 'import_block'}{os.pathsep}{ROOT}",
        "SHORTCONV_HIDE_IMPORTS": "ray,pydantic,fastapi,prometheus_client",
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "offline.py"), "--quick", "--vs", "none"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUMMARY offline") == 3, proc.stdout


def test_stage_timeouts_fit_the_budget() -> None:
    """Stage limits plus each stage's kill grace stay within 470 s (the run must end in 480)."""
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    limits = [int(n) for n in re.findall(r"^stage \w+ (\d+) ", script, re.M)]
    grace = re.search(r"timeout -k (\d+) ", script)
    assert len(limits) == len(STAGES) and grace, script
    assert sum(limits) + int(grace.group(1)) * len(limits) <= 470, limits
