"""bench/gpu_summary.py: the targets table from stage logs, with missing results reported."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_summary  # noqa: E402


def _rows(text: str) -> dict[str, list[str]]:
    rows = [ln.strip("|").split("|") for ln in text.splitlines() if ln.startswith("| ")]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows[1:]}


def test_table_reads_targets_and_reports_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "tests.log").write_text("a PASSED\n==== 1 failed, 12 passed in 80.1s ====\n")
    (tmp_path / "kernels.log").write_text(
        "SUMMARY kernels moe_triton E16,T=1 GBps=3000.0 ratio_vs_copy=0.700\n"
        "SUMMARY kernels moe_triton E16,T=8 GBps=2000.0 ratio_vs_copy=0.450\n"
        "SUMMARY target attention_decode_vs_copy value=0.812 target>=0.7 pass (Hq32 B=128)\n"
    )
    (tmp_path / "decode.log").write_text(
        "SUMMARY target graph_vs_eager_b1_lfm2_350m value=2.10 target>=3.0 FAIL\n"
    )
    (tmp_path / "offline.log").write_text("# wrote checkpoint\n")
    statuses = {"tests": "FAILED-rc1", "kernels": "ok", "decode": "ok", "offline": "TIMEOUT"}
    rows = _rows(gpu_summary.table(tmp_path, statuses))
    tests = rows["gpu tests (pytest -m gpu, or the plain runner)"]
    assert tests[0] == "1 failed, 12 passed in 80.1s" and tests[2].startswith("FAIL"), tests
    attn = rows["paged attention decode, largest B x ctx, of copy BW (Hq32 B=128)"]
    assert attn == ["0.812", ">= 0.70", "pass"]
    graph = rows["graph replay vs eager decode, batch 1, LFM2-350M"]
    assert graph == ["2.10", ">= 3x", "FAIL"]
    offline = rows["workload b bf16, ours vs transformers"]
    assert offline == ["not measured", ">= 5x", "FAIL (stage TIMEOUT)"]
    assert rows["fused MoE, of copy BW (chosen experts' bytes)"][0] == "0.45 .. 0.70"


def test_plain_runner_line_with_zero_failures_passes(tmp_path: Path) -> None:
    (tmp_path / "tests.log").write_text("0 passed, 0 failed, 3 skipped, 0 not run in 1s\n")
    (tmp_path / "offline.log").write_text(
        "SUMMARY offline shape=zaya1-100m status=skipped reason=no_zaya_here\n"
    )
    rows = _rows(gpu_summary.table(tmp_path, {"tests": "ok", "offline": "ok"}))
    assert rows["gpu tests (pytest -m gpu, or the plain runner)"][2] == "pass"
    (tmp_path / "tests.log").write_text(
        "x SKIPPED [ 9%]\n=== 39 skipped, 29 deselected in 0.34s ===\n"
    )
    tests = _rows(gpu_summary.table(tmp_path, {"tests": "ok"}))[
        "gpu tests (pytest -m gpu, or the plain runner)"
    ]
    assert tests == ["39 skipped, 29 deselected in 0.34s", "all pass", "pass"]
    assert rows["workload b bf16, ours vs transformers"] == ["no zaya here", ">= 5x", "skipped"]
