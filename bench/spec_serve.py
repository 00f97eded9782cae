"""Speculative decoding through `serve run`: TPOT at concurrency 1, output tokens/s at 8 and 32,
with speculation off, `ngram` and `draft_model`, the apps started one after the other.

    .venv/bin/python bench/spec_serve.py --shape lfm2-350m
    .venv/bin/python bench/spec_serve.py --quick        # tiny shape, short load (a smoke test)

One random checkpoint made into an early-exit pair (`shortconv.tiny.early_exit`: the target's
layers past `--draft-layers` scaled by `--draft-scale`, and its cut to those layers as the
draft, so the draft accepts on random weights). Each app is `serve run deployments/lfm2.yaml`
with only `model` (and `speculative_config`) set (bench/serve_procs.py); each is loaded the way
bench/serve_vs_llamacpp.py loads it: a warm-up request, then closed-loop streaming clients at
each concurrency (`--prompt-tokens` token ids, exactly `--max-tokens` out with `ignore_eos`).
TPOT is the median over requests of (last token's time - first token's time) / (tokens - 1),
from `usage.completion_tokens`: a verify step streams several tokens in one event, so the gap
between events is not a token's time. The machine is
shared by the three apps' runs in turn, so only the ratios to the `off` rows of one run mean
anything; the CPU model is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from offline import SHAPES  # noqa: E402
from serve_load import Result, stream_one  # noqa: E402
from serve_procs import ours, with_visible_tokens  # noqa: E402
from spec_decode import _cpu_model  # noqa: E402

from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from shortconv.tiny.early_exit import early_exit_pair  # noqa: E402


def spec_configs(draft: Path, k: int) -> dict[str, dict[str, Any] | None]:
    """The apps, by name: speculation off, then each method at k proposals."""
    return {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k},
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k},
    }


async def closed_loop(url: str, conc: int, n: int, args: argparse.Namespace) -> list[Result]:
    """`conc` clients streaming greedy completions until `n` are done."""
    rng = random.Random(args.seed)
    todo = [[rng.randrange(3, 250) for _ in range(args.prompt_tokens)] for _ in range(n)]
    body = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    body["model"] = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    done: list[Result] = []
    limits = httpx.Limits(max_connections=conc)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as c:

        async def client() -> None:
            while todo:
                done.append(
                    await stream_one(c, "/v1/completions", {**body, "prompt": todo.pop()}, {})
                )

        await asyncio.gather(*(client() for _ in range(conc)))
    return done


def load_stats(url: str, conc: int, args: argparse.Namespace) -> dict[str, float]:
    t0 = time.perf_counter()
    results = asyncio.run(closed_loop(url, conc, conc * args.requests_per_client, args))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    tpots = [sum(r.gaps) / (r.out_tokens - 1) for r in ok if r.out_tokens > 1]
    for r in results:
        if r.error:
            print(f"#   error: {r.error}", flush=True)
    return {
        "tok_s": sum(r.out_tokens for r in ok) / wall,
        "tpot_p50": statistics.median(tpots) if tpots else float("nan"),
        "errors": float(len(results) - len(ok)),
    }


def measure(name: str, app: dict[str, object], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One app: a warm-up request, then each concurrency."""
    with ours(app, args.start_timeout) as (url, _pid):
        asyncio.run(closed_loop(url, 1, 1, args))
        return [
            {"app": name, "concurrency": c, **load_stats(url, c, args)} for c in args.concurrency
        ]


def table(rows: list[dict[str, Any]]) -> str:
    base = {r["concurrency"]: r for r in rows if r["app"] == "off"}
    lines = [
        "| app | concurrency | TPOT p50 ms | vs off | output tok/s | vs off | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        b = base[r["concurrency"]]
        lines.append(
            f"| {r['app']} | {r['concurrency']} | {1e3 * r['tpot_p50']:.1f} | "
            f"{_ratio(r['tpot_p50'], b['tpot_p50'])} | {r['tok_s']:.1f} | "
            f"{_ratio(r['tok_s'], b['tok_s'])} | {r['errors']:.0f} |"
        )
    return "\n".join(lines)


def _ratio(ours: float, off: float) -> str:
    return f"{ours / off:.2f}x" if off > 0 else "-"  # an off row with no completed request


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="lfm2-350m", choices=sorted(SHAPES))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--draft-scale", type=float, default=0.1)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny shape, short load (a smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.shape, args.draft_layers, args.concurrency = "lfm2-tiny", 3, "1,2"
        args.requests_per_client, args.max_tokens, args.prompt_tokens = 1, 16, 16
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    print(f"# spec_serve {args.shape}, k = {args.k}; {_cpu_model()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        arch, overrides = SHAPES[args.shape]
        src = make_tiny_checkpoint(arch, Path(tmp) / "src", overrides, seed=0)
        target, draft = early_exit_pair(src, args.draft_layers, args.draft_scale, Path(tmp))
        # NOTE: both renamed alike, so the draft's token-to-id map still equals the target's.
        target, draft = with_visible_tokens(target), with_visible_tokens(draft)
        rows: list[dict[str, Any]] = []
        for name, spec in spec_configs(draft, args.k).items():
            app: dict[str, object] = {"model": str(target), "speculative_config": spec}
            rows += measure(name, app, args)
    print(table(rows), flush=True)
    print("SUMMARY spec_serve", " ".join(f"{r['app']}@{r['concurrency']}" for r in rows))


if __name__ == "__main__":
    main()
