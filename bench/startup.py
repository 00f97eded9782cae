"""`serve run deployments/lfm2.yaml` start-up, phase by phase, on the LFM2-350M-shaped checkpoint.

    .venv/bin/python bench/startup.py --ckpt-dir /tmp/ckpts --repeats 3
    .venv/bin/python bench/startup.py --model DIR       # a checkpoint of yours

Each repeat starts `serve run` afresh (its own Ray), polls `/v1/models` until it answers, reads
the replica's start-up report (`startup` in `/v1/internal/stats`) and stops it. On a machine
shared with other work the wall times are noisy: the table is the repeat with the least wall
time to ready, and every repeat's wall time is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_procs import ours  # noqa: E402


def checkpoint(args: argparse.Namespace) -> Path:
    """The checkpoint to serve: `--model`, else the 350M shape built once under `--ckpt-dir`."""
    if args.model:
        return Path(args.model)
    from offline import SHAPES

    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    arch, overrides = SHAPES["lfm2-350m"]
    out = Path(args.ckpt_dir) / "lfm2-350m"
    if not (out / "config.json").is_file():
        make_tiny_checkpoint(arch, out, overrides=overrides, seed=0)
    return out


def one_start(model: Path, timeout_s: float) -> dict[str, Any]:
    """One `serve run`: wall time to ready and the replica's start-up report."""
    t0 = time.monotonic()
    with ours({"model": str(model)}, timeout_s) as (url, _pid):
        ready_s = time.monotonic() - t0
        stats = httpx.get(f"{url}/v1/internal/stats", timeout=30).json()
    return {"ready_s": ready_s, "startup": stats.get("startup", {})}


def phase_rows(startup: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(process, phase, seconds): the replica's, then the core's and each TP rank's own."""
    rows = [("replica", "before __init__", startup["before_s"])]
    rows += [("replica", name, s) for name, s in startup["phases"]]
    for rep in [startup.get("core")] + list(startup.get("ranks", [])):
        if rep:
            rows.append((rep["who"], "before its phases", rep["before_s"]))
            rows += [(rep["who"], name, s) for name, s in rep["phases"]]
    return rows


def table(run: dict[str, Any]) -> str:
    st = run["startup"]
    lines = ["| process | phase | seconds |", "| --- | --- | --- |"]
    lines += [f"| {who} | {name} | {s:.2f} |" for who, name, s in phase_rows(st)]
    core = st.get("core") or {}
    lines.append(f"| replica | RSS | {st['rss_bytes'] / 2**20:.0f} MiB |")
    if core:
        lines.append(f"| core | RSS | {core['rss_bytes'] / 2**20:.0f} MiB |")
    lines.append(f"| **serve run** | **ready (wall)** | **{run['ready_s']:.1f}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: 350M shape)")
    p.add_argument("--ckpt-dir", default=str(Path.home() / ".cache" / "shortconv-bench"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="also print every run as JSON")
    args = p.parse_args(argv)
    model = checkpoint(args)
    runs = []
    for i in range(args.repeats):
        runs.append(one_start(model, args.timeout))
        print(f"# run {i + 1}: ready in {runs[-1]['ready_s']:.1f} s", flush=True)
        if args.json:
            print(json.dumps(runs[-1]), flush=True)
    best = min(runs, key=lambda r: r["ready_s"])
    print(f"# best of {len(runs)} (least wall time to ready), {model.name}:")
    print(table(best))


if __name__ == "__main__":
    main()
