"""The GPU check's final table: each target, the measured value, pass/fail.

    python bench/gpu_summary.py LOGS_DIR stage=status ...   # prints the table, appends it to
                                                           # LOGS_DIR/summary.md

Reads the stage logs bench/gpu_check.sh wrote (tests.log, kernels.log, decode.log, offline.log)
and their `SUMMARY target NAME value=V target>=G pass|FAIL (detail)` lines; a target whose line
is missing is reported with its stage's status (e.g. TIMEOUT), never silently dropped. The table
is Markdown, to paste into bench/RESULTS.md.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

TARGET = re.compile(r"^SUMMARY target (\S+) value=(\S+) target(>=\S+) (pass|FAIL)(?: \((.*)\))?")
KERNEL = re.compile(r"^SUMMARY kernels (\S+) (\S+) GBps=(\S+) ratio_vs_copy=(\S+)")
SECTION = re.compile(r"^SUMMARY kernels section=(\S+) status=(\S+)")
# pytest's last line ("== 3 passed, 2 skipped in 9.1s ==") or the plain runner's.
TESTS = re.compile(r"(\d+ (?:passed|failed|skipped|errors?|deselected)\b.*? in [\d.]+s.*?)[ =]*$")


@dataclass(frozen=True)
class Row:
    target: str
    measured: str
    goal: str
    result: str


# (target line name, log, label, goal)
TARGETS = (
    (
        "attention_decode_vs_copy",
        "kernels",
        "paged attention decode, largest B x ctx, of copy BW",
        ">= 0.70",
    ),
    (
        "graph_vs_eager_b1_lfm2_350m",
        "decode",
        "graph replay vs eager decode, batch 1, LFM2-350M",
        ">= 3x",
    ),
    ("offline_b_vs_hf", "offline", "workload b bf16, ours vs transformers", ">= 5x"),
)


def _lines(logs: Path, stage: str) -> list[str]:
    path = logs / f"{stage}.log"
    return path.read_text(errors="replace").splitlines() if path.is_file() else []


def tests_row(logs: Path, status: str) -> Row:
    found = [m.group(1).strip(" =") for ln in _lines(logs, "tests") if (m := TESTS.search(ln))]
    measured = found[-1] if found else "no result line"
    ok = status == "ok" and bool(found) and not re.search(r"\b[1-9]\d* (failed|error)", measured)
    return Row(
        "gpu tests (pytest -m gpu, or the plain runner)",
        measured,
        "all pass",
        "pass" if ok else f"FAIL ({status})",
    )


def target_row(logs: Path, name: str, stage: str, label: str, goal: str, status: str) -> Row:
    lines = _lines(logs, stage)
    for ln in lines:
        if (m := TARGET.match(ln)) and m.group(1) == name:
            detail = f" ({m.group(5)})" if m.group(5) else ""
            return Row(label + detail, m.group(2), goal, m.group(4))
    skipped = [ln for ln in lines if "status=skipped" in ln]
    if skipped:
        return Row(label, skipped[-1].split("reason=")[-1].replace("_", " "), goal, "skipped")
    sections = dict(SECTION.findall("\n".join(lines)))
    why = "kernel module missing" if "missing" in sections.values() else f"stage {status}"
    return Row(label, "not measured", goal, f"FAIL ({why})")


def ratio_range_row(logs: Path, kernel: str, label: str) -> Row:
    ratios = [
        float(m.group(4))
        for ln in _lines(logs, "kernels")
        if (m := KERNEL.match(ln)) and m.group(1) == kernel
    ]
    if not ratios:
        return Row(label, "not measured", "report", "-")
    return Row(label, f"{min(ratios):.2f} .. {max(ratios):.2f}", "report", "-")


def table(logs: Path, statuses: dict[str, str]) -> str:
    rows = [tests_row(logs, statuses.get("tests", "not run"))]
    for name, stage, label, goal in TARGETS:
        rows.append(target_row(logs, name, stage, label, goal, statuses.get(stage, "not run")))
    rows.append(
        ratio_range_row(logs, "moe_triton", "fused MoE, of copy BW (chosen experts' bytes)")
    )
    rows.append(ratio_range_row(logs, "update_triton", "short-conv decode update, of copy BW"))
    out = ["| target | measured | goal | result |", "| --- | --- | --- | --- |"]
    out += [f"| {r.target} | {r.measured} | {r.goal} | {r.result} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    logs = Path(argv[0])
    statuses = dict(a.split("=", 1) for a in argv[1:])
    text = table(logs, statuses)
    if statuses.get("dry_run") == "1":
        text = "(dry run: imports and arguments only, nothing measured)\n\n" + text
    print(text)
    with (logs / "summary.md").open("a") as f:
        f.write("\n## Targets\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
