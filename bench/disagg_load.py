"""Prefill/decode disaggregation through `serve run` (docs/disaggregation.md): TTFT at
concurrency 1, and inter-token latency at concurrency 32 while long prompts keep arriving, with
and without disaggregation, the two apps started one after the other.

    .venv/bin/python bench/disagg_load.py --shape lfm2-350m
    .venv/bin/python bench/disagg_load.py --quick        # tiny shape, short load (a smoke test)

One random checkpoint (bench/offline.py SHAPES). Each app is `serve run deployments/lfm2.yaml`
with the model and the CPUs set (bench/serve_procs.py): `together` is one replica reserving
`--cpus`; `disaggregated` is one prefill and one decode replica reserving half of it each, so
both apps hold the same share of the machine (and each replica half the torch threads);
`disaggregated-threads` reserves the same halves but gives each replica `together`'s threads
(`torch_threads`), so a prefill running alone uses every core, as it does in `together`.
Each app gets a warm-up request, then:

* TTFT: `--ttft-requests` greedy completions one at a time (`--prompt-tokens` token ids, 1
  token out); p50 of the time to the first streamed token.
* Inter-token latency under long prompts: `--concurrency` clients stream `--decode-tokens`
  tokens each (`ignore_eos`) from short prompts, `--requests-per-client` times, while one more
  client sends `--long-tokens`-token prompts (1 token out) back to back until they finish;
  p50 and p99 of the gaps between the short streams' content events. A long prompt's prefill
  stalls every stream on its replica when the two share it: that is what the split removes.

Only the ratios of one run mean anything (the machine is shared; the CPU model is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from offline import SHAPES  # noqa: E402
from serve_load import Result, pct, stream_one  # noqa: E402
from serve_procs import ours, with_visible_tokens  # noqa: E402
from spec_decode import _cpu_model  # noqa: E402

from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402


def apps(cpus: float, concurrency: int) -> dict[str, dict[str, Any]]:
    """The two apps' args (over deployments/lfm2.yaml's), by name: the same CPUs in all.
    NOTE: room for every stream and a long prompt in one batch, so that the long prompt never
    waits for a stream to end (which would hide the stall being measured)."""
    half = round(cpus / 2, 1)
    split = {"prefill_replicas": 1, "decode_replicas": 1}
    seqs = {"max_num_seqs": max(32, concurrency + 2)}
    disagg = {"replica_num_cpus": half, "disaggregation": split, **seqs}
    return {
        "together": {"replica_num_cpus": cpus, **seqs},
        "disaggregated": disagg,
        "disaggregated-threads": {**disagg, "torch_threads": max(1, round(cpus))},
    }


class Load:
    """Token-id prompts and the request bodies, from the run's seed."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.rng = random.Random(args.seed)
        self.model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

    def prompt(self, n: int) -> list[int]:
        # NOTE: fresh random ids each time, so no request resumes another's prefix checkpoint.
        return [self.rng.randrange(3, 250) for _ in range(n)]

    def body(self, n_prompt: int, n_out: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": self.prompt(n_prompt),
            "max_tokens": n_out,
            "temperature": 0.0,
            "ignore_eos": True,
        }

    def client(self, conc: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=conc)
        return httpx.AsyncClient(
            base_url=self.url, timeout=self.args.request_timeout, limits=limits
        )


async def ttft_run_warm(load: Load) -> None:
    """One request of each kind, so that no measured one pays for a first call's set-up."""
    a = load.args
    async with load.client(1) as c:
        for n_prompt in (a.prompt_tokens, a.long_tokens):
            await stream_one(c, "/v1/completions", load.body(n_prompt, 2), {})


async def ttft_run(load: Load) -> list[Result]:
    a = load.args
    async with load.client(1) as c:
        return [
            await stream_one(c, "/v1/completions", load.body(a.prompt_tokens, 1), {})
            for _ in range(a.ttft_requests)
        ]


async def itl_run(load: Load) -> tuple[list[Result], list[Result]]:
    """The short streams' results and the long prompts' results."""
    a = load.args
    streams: list[Result] = []
    longs: list[Result] = []
    async with load.client(a.concurrency + 1) as c:

        async def short_client() -> None:
            for _ in range(a.requests_per_client):
                body = load.body(a.prompt_tokens, a.decode_tokens)
                streams.append(await stream_one(c, "/v1/completions", body, {}))

        async def long_client(stop: asyncio.Event) -> None:
            while not stop.is_set():
                body = load.body(a.long_tokens, 1)
                longs.append(await stream_one(c, "/v1/completions", body, {}))

        stop = asyncio.Event()
        sender = asyncio.create_task(long_client(stop))
        await asyncio.gather(*(short_client() for _ in range(a.concurrency)))
        stop.set()
        await sender
    return streams, longs


def errors_of(results: list[Result]) -> int:
    for r in results:
        if r.error:
            print(f"#   error: {r.error}", flush=True)
    return sum(1 for r in results if not r.ok)


def measure(name: str, app: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    with ours(app, args.start_timeout) as (url, _pid):
        load = Load(url, args)
        asyncio.run(ttft_run_warm(load))
        ttft = asyncio.run(ttft_run(load))
        streams, longs = asyncio.run(itl_run(load))
        stats = httpx.get(f"{url}/v1/internal/stats", timeout=60).json()
    gaps = [g for r in streams if r.ok for g in r.gaps]
    return {
        "app": name,
        "ttft_p50": pct([r.ttft for r in ttft if r.ok and r.ttft is not None], 0.5),
        "itl_p50": pct(gaps, 0.5),
        "itl_p99": pct(gaps, 0.99),
        "long_prompts": sum(1 for r in longs if r.ok),
        "errors": errors_of(ttft) + errors_of(streams) + errors_of(longs),
        # Prompts the decode replica imported from a prefill replica: 0 for `together`.
        "handoffs": stats.get("handoff", {}).get("imported", 0),
    }


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = [
        "| app | TTFT p50 ms @1 | vs together | ITL p50 ms @C | ITL p99 ms @C | p99 vs together "
        "| long prompts | handoffs | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['app']} | {1e3 * r['ttft_p50']:.1f} | {_ratio(r['ttft_p50'], base['ttft_p50'])}"
            f" | {1e3 * r['itl_p50']:.2f} | {1e3 * r['itl_p99']:.2f} | "
            f"{_ratio(r['itl_p99'], base['itl_p99'])} | {r['long_prompts']} | {r['handoffs']} | "
            f"{r['errors']} |"
        )
    return "\n".join(lines)


def _ratio(ours: float, base: float) -> str:
    return f"{ours / base:.2f}x" if base > 0 else "-"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="lfm2-350m", choices=sorted(SHAPES))
    ap.add_argument("--cpus", type=float, default=round(len(os.sched_getaffinity(0)) - 0.2, 1))
    ap.add_argument("--ttft-requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--long-tokens", type=int, default=2048)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--apps", help="comma-separated (default: all three; --quick: the first two)")
    ap.add_argument("--quick", action="store_true", help="tiny shape, short load (a smoke test)")
    args = ap.parse_args(argv)
    every = "together,disaggregated" + ("" if args.quick else ",disaggregated-threads")
    args.apps = args.apps or every
    if args.quick:
        args.shape, args.ttft_requests, args.prompt_tokens = "lfm2-tiny", 3, 16
        args.concurrency, args.requests_per_client = 4, 1
        args.decode_tokens, args.long_tokens = 8, 64
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    print(
        f"# disagg_load {args.shape}, {args.cpus} CPUs per app, concurrency {args.concurrency},"
        f" long prompts of {args.long_tokens} tokens; {_cpu_model()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        arch, overrides = SHAPES[args.shape]
        # NOTE: visible tokens: a random model mostly picks reserved special tokens, which
        # stream as empty text, and the client times text events (bench/serve_procs.py)
        model = with_visible_tokens(
            make_tiny_checkpoint(arch, Path(tmp) / "ckpt", overrides, seed=0)
        )
        rows = [
            measure(name, {"model": str(model), **app}, args)
            for name, app in apps(args.cpus, args.concurrency).items()
            if name in args.apps.split(",")
        ]
    print(table(rows), flush=True)
    print("SUMMARY disagg_load", " ".join(r["app"] for r in rows))


if __name__ == "__main__":
    main()
