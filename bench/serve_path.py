"""Where one stream's time per output token goes on its way out (concurrency 1).

    .venv/bin/python bench/serve_path.py --tiny lfm2                 # tiny random checkpoint
    .venv/bin/python bench/serve_path.py --model /path/to/ckpt --prompt-tokens 140 --max-tokens 128

The same greedy request (`ignore_eos`) is timed three ways, each as the median gap between
consecutive output tokens (TPOT):

    engine  LLMEngine.step() in a loop, this process (the offline engine)
    async   a second engine behind AsyncEngine in this process: + the thread -> asyncio hand-off
    serve   `serve run deployments/lfm2.yaml` at its defaults (or `--engine-process`,
            `--gil-switch-ms` set), streamed over HTTP: + the replica's
            generator, the handle stream to the ingress, SSE framing, the proxy

one request of each per round, `--repeats` rounds with `serve run` up throughout, so a drift
in the machine's speed (large on a shared VM) falls on the three alike; the differences are the
hops' costs, and "serve / engine" is the median of the rounds' own ratios. A `--model` checkpoint
is served from its `-text` sibling (serve_procs.with_visible_tokens), so every token streams.
It also prints the replica's start-up report (phases, RSS, torch threads) and the time from
`serve run` to ready. Run it on a quiet machine: every hop shares the CPUs with the model.
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
from serve_procs import cpu_snapshot, cpu_used, ours, with_visible_tokens  # noqa: E402

from deployments.frontend.engine.async_engine import AsyncEngine  # noqa: E402
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


def interleaved(args: argparse.Namespace, model_dir: Path, prompt: list[int]) -> dict:
    """TPOT of the three hops, one request each per round, `--repeats` rounds: the in-process
    engine and AsyncEngine are built beside the running `serve run` (idle while the others
    time), so drift in the machine's speed falls on all three alike and the per-round ratios
    cancel it. Also the CPU each `serve run` process spent per output token, and start-up."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    model_args: dict[str, object] = (
        {"model": str(model_dir)} if args.model else {"tiny_arch": args.tiny}
    )
    if args.engine_process is not None:
        model_args["engine_process"] = args.engine_process == "on"
    if args.gil_switch_ms is not None:
        model_args["gil_switch_interval_ms"] = args.gil_switch_ms
    engine = build_engine(model_dir, dtype="float32", engine_config=EngineConfig())
    # NOTE: a second engine behind the loop: only the loop's thread may touch its engine.
    loop = AsyncEngine(build_engine(model_dir, dtype="float32"), admission_limit=4)
    loop.start()
    rounds: dict[str, list[float]] = {"engine": [], "async": [], "serve": []}
    t0 = time.perf_counter()
    try:
        with ours(model_args, 600.0) as (url, pid):
            ready = time.perf_counter() - t0
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            asyncio.run(serve_tpot(url, model, prompt, args.max_tokens))  # warm-up
            before = cpu_snapshot(pid)
            for _ in range(args.repeats):
                rounds["engine"].append(engine_tpot(engine, prompt, params))
                rounds["async"].append(asyncio.run(async_tpot(loop, prompt, params)))
                rounds["serve"].append(asyncio.run(serve_tpot(url, model, prompt, args.max_tokens)))
            tokens = args.repeats * args.max_tokens
            per_token = [(s / tokens, n) for s, n in cpu_used(before, pid)]
            startup = httpx.get(f"{url}/v1/internal/stats", timeout=30).json().get("startup", {})
    finally:
        loop.shutdown()
        engine.shutdown()
    got: dict[str, Any] = {k: statistics.median(v) for k, v in rounds.items()}
    pairs = zip(rounds["serve"], rounds["engine"], strict=True)
    got["ratio"] = statistics.median(s / e for s, e in pairs)
    got.update(ready_s=ready, startup=startup, cpu_per_token=per_token, rounds=rounds)
    return got


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
    p.add_argument("--engine-process", choices=["on", "off"], help="default: the shipped one")
    p.add_argument("--gil-switch-ms", type=float, help="the replica's (default: the shipped one)")
    args = p.parse_args(argv)
    prompt = [3 + (7 * i) % 200 for i in range(args.prompt_tokens)]
    model_dir = with_visible_tokens(Path(args.model)) if args.model else tiny_checkpoint(args.tiny)
    got = interleaved(args, model_dir, prompt)
    print("| hop | TPOT p50 (ms) | added (ms) |\n| --- | --- | --- |")
    prev = None
    for name in ("engine", "async", "serve"):
        value = 1e3 * got[name]
        added = "" if prev is None else f"{value - prev:+.2f}"
        print(f"| {name} | {value:.2f} | {added} |")
        prev = value
    print(f"# serve / engine, median of the rounds' ratios: {got['ratio']:.3f}")
    for name, values in got["rounds"].items():
        print(f"# {name} by round (ms): {' '.join(f'{1e3 * v:.1f}' for v in values)}")
    for cpu, name in got.get("cpu_per_token", []):
        if cpu >= 1e-4:
            print(f"# CPU per output token {1e3 * cpu:6.2f} ms  {name}")
    print(f"# ready {got['ready_s']:.1f}s after `serve run`; replica start-up:")
    print(json.dumps(got["startup"], indent=1))


if __name__ == "__main__":
    main()
