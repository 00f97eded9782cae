"""`serve run`'s processes at ready: resident (RSS) and proportional (PSS) memory, one by one.

    .venv/bin/python bench/serve_memory.py                    # tiny random LFM2, lfm2.yaml
    .venv/bin/python bench/serve_memory.py --model DIR        # a checkpoint of ours

Run it from each of two virtual environments (e.g. before and after a torch upgrade) on the same
machine and hour: PSS splits a page that several processes map (a shared library, the
interpreter) among them, so a library that every Ray worker loads counts once in the PSS sum
and once per process in the RSS sum. A request is served first, so the engine has run a step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_procs import ours, tree_memory  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: tiny random)")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    import torch

    t0 = time.monotonic()
    with ours({"model": args.model}, args.timeout) as (url, pid):
        ready_s = time.monotonic() - t0
        body = {"prompt": "hello", "max_tokens": 8, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        print(f"# torch {torch.__version__}: serve run tree of pid {pid}", flush=True)
        rss, pss = tree_memory(pid, show_mb=50.0)
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "ready_s": round(ready_s, 1),
                "rss_gb": round(rss / 1e9, 2),
                "pss_gb": round(pss / 1e9, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
