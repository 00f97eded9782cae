"""The offline engine under serve_vs_llamacpp.py's closed loop: the serving path's reference.

    .venv/bin/python bench/closed_loop.py --model /path/to/lfm2-350m --concurrency 1 8 32

`conc` clients, each sending its next request when its last one finishes, until `3 * conc`
requests are done: the same random 140-token prompts (same seed), exactly 128 output tokens,
greedy. The engine is stepped in this process (no thread, no Serve), so the columns it prints
(output tok/s, TPOT and inter-token gaps, TTFT) are what `serve run` would show if its path cost
nothing; the difference from the served rows is the serving path's cost at that concurrency.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from serve_load import pct  # noqa: E402


def closed_loop(engine: Any, conc: int, requests: int, args: argparse.Namespace) -> dict:
    """Run `requests` requests through `engine`, at most `conc` in flight, each slot refilled
    when its request finishes; per-request token times come from the step that produced them."""
    from shortconv.sampling.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 250) for _ in range(args.prompt_tokens)] for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    sent: dict[str, float] = {}
    times: dict[str, list[float]] = {}

    def submit() -> None:
        rid = engine.add_request(prompts.pop(), params)
        sent[rid], times[rid] = time.perf_counter(), []

    t0 = time.perf_counter()
    for _ in range(min(conc, len(prompts))):
        submit()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            times[out.request_id].extend(now for _ in out.new_token_ids)
            if out.finished and prompts:
                submit()
    wall = time.perf_counter() - t0
    gaps = {rid: [b - a for a, b in zip(t, t[1:], strict=False)] for rid, t in times.items()}
    every_gap = [g for gs in gaps.values() for g in gs if g > 0]
    tokens = sum(len(t) for t in times.values())
    return {
        "tokens": tokens,
        "tok_s": tokens / wall,
        "tpot_p50": pct([statistics.fmean(g) for g in gaps.values() if g], 0.5),
        "itl_p50": pct(every_gap, 0.5),
        "itl_p99": pct(every_gap, 0.99),
        "ttft_p50": pct([times[rid][0] - sent[rid] for rid in times if times[rid]], 0.5),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=140)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from shortconv.llm import build_engine

    args = parse(argv)
    engine = build_engine(Path(args.model), dtype="float32")
    print(
        "| concurrency | out tok/s | TPOT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | TTFT p50 (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    try:
        for conc in args.concurrency:
            r = closed_loop(engine, conc, args.requests_per_client * conc, args)
            ms = [f"{1e3 * r[k]:.0f}" for k in ("tpot_p50", "itl_p50", "itl_p99")]
            print(f"| {conc} | {r['tok_s']:.1f} | {' | '.join(ms)} | {r['ttft_p50']:.2f} |")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
