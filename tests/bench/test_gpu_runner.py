"""bench/gpu_runner.py with pytest hidden: every tests/gpu module imports under the stand-in, and
marks, parametrize, skips and failures are handled the way pytest would handle them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_MODULES = sorted(p.stem for p in (ROOT / "tests" / "gpu").glob("test_*.py"))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'bench' / 'import_block'}{os.pathsep}{ROOT}",
        "SHORTCONV_HIDE_IMPORTS": "pytest",
    }
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_runner.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_every_gpu_module_imports_without_pytest() -> None:
    proc = _run("--dry-run")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "pytest stand-in" in out, out
    assert "FAIL" not in out, out
    for mod in GPU_MODULES:
        assert f" {mod}::test_" in out, (mod, out)


def test_marks_params_skips_and_failures(tmp_path: Path) -> None:
    (tmp_path / "test_fake.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.unrelated_mark\n"
        "@pytest.mark.parametrize('a,b', [(1, 2), pytest.param(3, 4, marks=pytest.mark.skipif("
        "True, reason='param skip'))])\n"
        "def test_add(a, b):\n    assert a + 1 == b\n"
        "@pytest.mark.skipif(True, reason='never')\n"
        "def test_skipped():\n    raise RuntimeError\n"
        "def test_fails():\n    assert 1 == 2\n"
        "def test_needs_fixture(tmp_path):\n    pass\n"
        "def test_runtime_skip():\n    pytest.skip('inside')\n"
        "def test_plain():\n    with pytest.raises(ValueError, match='x'):\n"
        "        raise ValueError('x')\n"
    )
    proc = _run(str(tmp_path / "test_fake.py"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # one failure
    assert "2 passed, 1 failed, 4 skipped, 0 not run" in out, out
    assert "PASS test_fake::test_add[0]" in out and "SKIP test_fake::test_add[1]" in out, out
    assert "needs pytest fixtures ['tmp_path']" in out, out
