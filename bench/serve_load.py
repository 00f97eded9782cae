"""Load a running `serve run` service with concurrent streaming clients (OpenAI API, loopback).

    .venv/bin/python bench/serve_load.py --url http://127.0.0.1:8000 --concurrency 8 --requests 64
    .venv/bin/python bench/serve_load.py --sessions 16 --turns 4      # x-session-id reuse vs none
    .venv/bin/python bench/serve_load.py --launch deployments/lfm2.yaml ...  # start one, then load
    .venv/bin/python bench/serve_load.py --shared-prefix 1024 --prompt-tokens 64 ...  # workload d

Plain load: `--concurrency` clients stream `/v1/completions` (token-id prompts, `ignore_eos`, so
every request yields exactly `--max-tokens`) until `--requests` are done or `--duration` seconds
pass. Sessions: `--sessions` conversations of `--turns` turns on `/v1/chat/completions`, each
turn re-sending the whole conversation; run once with the `x-session-id` header (the replica
resumes the kept state: only the new suffix is prefilled) and once without, interleaved
(with, without, with, without: `--runs` pairs). Reported: requests/s, output tokens/s (from
`usage.completion_tokens`), TTFT and inter-token latency p50/p99 (ITL: gaps between streamed
content events, each usually one token), cached prompt tokens (`usage.prompt_tokens_details`)
and errors. Clients, requests and time are all bounded; only loopback URLs are accepted.
With `--launch YAML`, a copy of the YAML with a free port runs as `serve run` in its own
process group with its own RAY_TMPDIR, and is stopped (SIGTERM, then SIGKILL of that group).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ("127.0.0.1", "localhost", "::1")
WORDS = [f"w{i}" for i in range(200)]


@dataclass
class Result:
    ok: bool = False
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    out_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    error: str | None = None


async def stream_one(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]
) -> Result:
    """One streamed request; parses SSE `data:` lines until `[DONE]`."""
    res, t0, last = Result(), time.perf_counter(), None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.ok = res.error is None
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    continue
                now = time.perf_counter()
                for ch in obj.get("choices") or []:
                    piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                    if piece:
                        res.text += piece
                        if res.ttft is None:
                            res.ttft = now - t0
                        elif last is not None:
                            res.gaps.append(now - last)
                        last = now
                usage = obj.get("usage")
                if usage:
                    res.out_tokens = usage.get("completion_tokens", 0)
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(q * len(vals)))]


def report(tag: str, results: list[Result], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    out = sum(r.out_tokens for r in ok)
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    stats = {
        "req_s": len(ok) / wall,
        "tok_s": out / wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "itl_p50": pct(gaps, 0.5),
        "itl_p99": pct(gaps, 0.99),
        "errors": len(results) - len(ok),
        "cached_frac": cached / max(1, prompt),
    }
    print(
        f"SUMMARY serve_load {tag} requests={len(results)} wall_s={wall:.2f} "
        f"req_s={stats['req_s']:.2f} out_tok_s={stats['tok_s']:.1f} "
        f"ttft_p50_ms={1e3 * stats['ttft_p50']:.0f} ttft_p99_ms={1e3 * stats['ttft_p99']:.0f} "
        f"itl_p50_ms={1e3 * stats['itl_p50']:.1f} itl_p99_ms={1e3 * stats['itl_p99']:.1f} "
        f"cached_prompt_frac={stats['cached_frac']:.2f} errors={stats['errors']}",
        flush=True,
    )
    for r in results:
        if r.error:
            print(f"#   error: {r.error}")
            break
    return stats


async def plain_load(args: argparse.Namespace, model: str) -> None:
    rng, issued, results = random.Random(args.seed), 0, []
    deadline = time.monotonic() + args.duration
    shared = [rng.randrange(3, 250) for _ in range(args.shared_prefix)]

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal issued
        while issued < args.requests and time.monotonic() < deadline:
            issued += 1
            if shared:  # workload (d): one shared system prompt + a suffix of exactly N tokens
                prompt = shared + [rng.randrange(3, 250) for _ in range(args.prompt_tokens)]
            else:
                n = rng.randint(args.prompt_tokens // 2, args.prompt_tokens)
                prompt = [rng.randrange(3, 250) for _ in range(n)]
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            results.append(await stream_one(client, "/v1/completions", body, {}))

    async with make_client(args) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
        tag = f"plain concurrency={args.concurrency}"
        if shared:
            tag += f" shared_prefix={len(shared)} suffix={args.prompt_tokens}"
        report(tag, results, time.perf_counter() - t0)


async def session_round(args: argparse.Namespace, model: str, tag: str, reuse: bool) -> None:
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.concurrency)
    results: list[Result] = []

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    async def conversation(client: httpx.AsyncClient, i: int) -> None:
        msgs = [{"role": "system", "content": words(args.prompt_tokens // 3)}]
        headers = {"x-session-id": f"{tag}-{i}"} if reuse else {}
        for _ in range(args.turns):
            msgs.append({"role": "user", "content": words(args.user_words)})
            body = {
                "model": model,
                "messages": msgs,
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            async with sem:
                res = await stream_one(client, "/v1/chat/completions", body, headers)
            results.append(res)
            if not res.ok:
                return
            msgs.append({"role": "assistant", "content": res.text})

    async with make_client(args) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(client, i) for i in range(args.sessions)))
        report(
            f"sessions={args.sessions}x{args.turns} reuse={reuse}",
            results,
            time.perf_counter() - t0,
        )


def make_client(args: argparse.Namespace) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    return httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout, limits=limits)


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


@contextmanager
def launched(yaml_path: str, timeout_s: float, app_args: list[str]):  # noqa: ANN201 - Iterator[str]
    """`serve run` on `yaml_path` (with `KEY=VALUE` overrides of the first application's args)
    on a free loopback port; yields the base URL."""
    import yaml

    sys.path.insert(0, str(ROOT))  # run from a source checkout
    from deployments.serve.serve_run import ServeRunError, serve_run

    config = yaml.safe_load(Path(yaml_path).read_text())
    for item in app_args:
        key, _, raw = item.partition("=")
        config["applications"][0]["args"][key] = yaml.safe_load(raw)
    try:
        with serve_run(config, timeout_s, env={"PYTHONPATH": str(ROOT)}) as (url, log):
            print(f"# launched serve run {yaml_path} on {url} (log {log})", flush=True)
            yield url
    except ServeRunError as exc:
        raise SystemExit(str(exc)) from None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", metavar="YAML", help="start `serve run YAML` on a free port first")
    p.add_argument("--launch-timeout", type=float, default=300.0)
    p.add_argument(
        "--app-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --launch: override an app arg, e.g. enable_graphs=false",
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--duration", type=float, default=120.0, help="stop issuing after this")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="plain mode: every prompt is one shared N-token prefix + exactly --prompt-tokens",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sessions", type=int, default=0, help="> 0: the multi-turn session mode")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-words", type=int, default=12)
    p.add_argument("--runs", type=int, default=1, help="session mode: with/without pairs")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 1 <= args.concurrency <= 256 or args.requests > 10_000 or args.sessions > 1_000:
        raise SystemExit("bounded load only: concurrency 1..256, requests <= 10000")
    if args.launch:
        with launched(args.launch, args.launch_timeout, args.app_arg) as url:
            args.url = url
            run(args)
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    if urlparse(args.url).hostname not in LOOPBACK:
        raise SystemExit(f"{args.url}: loopback URLs only")
    model = model_name(args.url)
    print(f"# serve_load {args.url} model {model}, load avg {os.getloadavg()[0]:.2f}", flush=True)
    if not args.sessions:
        asyncio.run(plain_load(args, model))
        return
    for r in range(args.runs):
        for reuse in (True, False):
            asyncio.run(session_round(args, model, f"run{r}", reuse))


if __name__ == "__main__":
    main()
