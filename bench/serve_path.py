"""Where one stream's time per output token goes on its way out (concurrency 1).

    .venv/bin/python bench/serve_path.py --tiny lfm2                 # tiny random checkpoint
    .venv/bin/python bench/serve_path.py --model /path/to/ckpt --prompt-tokens 140 --max-tokens 128

The same greedy request (`ignore_eos`) is timed three ways, each as the median gap between
consecutive output tokens (TPOT):

    engine  LLMEngine.step() in a loop, this process (the offline engine)
    async   the same engine behind AsyncEngine in this process: + the thread -> asyncio hand-off
    serve   `serve run deployments/lfm2.yaml` at its defaults, streamed over HTTP: + the replica's
            generator, the handle stream to the ingress, SSE framing, the proxy

so the differences are the hops' costs. It also prints the replica's start-up report (phases,
RSS, torch threads) and the time from `serve run` to ready. Run it on a quiet machine: every
hop shares the CPUs with the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from serve_load import stream_one  # noqa: E402
from serve_procs import cpu_snapshot, cpu_used, ours  # noqa: E402

from deployments.async_engine import AsyncEngine  # noqa: E402
from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.llm import build_engine  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402


def median_gap(times: list[float]) -> float:
    """Median gap between consecutive decode tokens (the first token's TTFT excluded)."""
    return statistics.median(b - a for a, b in zip(times[1:], times[2:], strict=False))


def engine_tpot(engine: Any, prompt: list[int], params: SamplingParams) -> float:
    rid, times = engine.add_request(prompt, params), []
    while engine.has_unfinished():
        if any(o.request_id == rid for o in engine.step()):
            times.append(time.perf_counter())
    return median_gap(times)


async def async_tpot(loop: AsyncEngine, prompt: list[int], params: SamplingParams) -> float:
    times = []
    async for _ in loop.generate(prompt, params, f"async-{time.monotonic_ns()}"):
        times.append(time.perf_counter())
    return median_gap(times)


async def serve_tpot(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        res = await stream_one(client, "/v1/completions", body, {})
    if not res.ok or len(res.gaps) < 2:
        raise SystemExit(f"serve request failed: {res.error}")
    return statistics.median(res.gaps[1:])


def in_process(model_dir: Path, prompt: list[int], params: SamplingParams, repeats: int) -> dict:
    engine = build_engine(model_dir, dtype="float32", engine_config=EngineConfig())
    offline = [engine_tpot(engine, prompt, params) for _ in range(repeats)]
    loop = AsyncEngine(engine, admission_limit=4)
    loop.start()
    try:
        handed = [asyncio.run(async_tpot(loop, prompt, params)) for _ in range(repeats)]
    finally:
        loop.shutdown()
    return {"engine": statistics.median(offline), "async": statistics.median(handed)}


def through_serve(args: argparse.Namespace, prompt: list[int]) -> dict:
    """TPOT through `serve run`, and the CPU each of its processes spent per output token."""
    model_args = {"model": args.model} if args.model else {"tiny_arch": args.tiny}
    t0 = time.perf_counter()
    with ours(model_args, 600.0) as (url, pid):
        ready = time.perf_counter() - t0
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(serve_tpot(url, model, prompt, args.max_tokens))  # warm-up
        before = cpu_snapshot(pid)
        tpots = [
            asyncio.run(serve_tpot(url, model, prompt, args.max_tokens))
            for _ in range(args.repeats)
        ]
        per_token = [(s / (args.repeats * args.max_tokens), n) for s, n in cpu_used(before, pid)]
        startup = httpx.get(f"{url}/v1/internal/stats", timeout=30).json().get("startup", {})
    return {
        "serve": statistics.median(tpots),
        "ready_s": ready,
        "startup": startup,
        "cpu_per_token": per_token,
    }


def tiny_checkpoint(arch: str) -> Path:
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(arch, Path(tempfile.mkdtemp(prefix="scpath-")), seed=0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: a tiny random one)")
    p.add_argument("--tiny", default="lfm2", choices=["lfm2", "lfm2_moe"])
    p.add_argument("--prompt-tokens", type=int, default=140)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-serve", action="store_true", help="the in-process hops only")
    args = p.parse_args(argv)
    prompt = [3 + (7 * i) % 200 for i in range(args.prompt_tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    model_dir = Path(args.model) if args.model else tiny_checkpoint(args.tiny)
    got = in_process(model_dir, prompt, params, args.repeats)
    if not args.no_serve:
        got.update(through_serve(args, prompt))
    ms = {k: 1e3 * got[k] for k in ("engine", "async", "serve") if k in got}
    print("| hop | TPOT p50 (ms) | added (ms) |\n| --- | --- | --- |")
    prev = None
    for name, value in ms.items():
        added = "" if prev is None else f"{value - prev:+.2f}"
        print(f"| {name} | {value:.2f} | {added} |")
        prev = value
    for cpu, name in got.get("cpu_per_token", []):
        if cpu >= 1e-4:
            print(f"# CPU per output token {1e3 * cpu:6.2f} ms  {name}")
    if "ready_s" in got:
        print(f"# ready {got['ready_s']:.1f}s after `serve run`; replica start-up:")
        print(json.dumps(got["startup"], indent=1))


if __name__ == "__main__":
    main()
