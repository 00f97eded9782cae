"""`serve run` at its shipped defaults against llama.cpp's `llama-server` on the same weights.

    .venv/bin/python bench/serve_vs_llamacpp.py --model /path/to/lfm2-350m --out table.md
    .venv/bin/python bench/serve_vs_llamacpp.py --dry-run       # about a minute, tiny checkpoint

The full run (issue #29's table): finds `llama-server` (--llama-server, $LLAMA_SERVER, PATH, or
its build cache) or builds it from the llama-cpp-python sdist (bench/serve_llamacpp.py),
converts the checkpoint to an f32 GGUF with llama.cpp's convert_hf_to_gguf.py, and then, for
`--rounds` rounds, starts one server at a time (ours: `serve run deployments/lfm2.yaml` with only
`model` set, no environment of ours; theirs: `-t <cores> -c 16384 -np 32`), times it to ready,
loads it at each concurrency with the same streaming client (bench/serve_load.py:
`--prompt-tokens` token ids, exactly `--max-tokens` out with `ignore_eos`, closed loop so that
new prompts keep arriving), sums the resident memory of its whole process tree (RSS, and PSS,
which counts a page shared by several processes once), and stops it.
The offline engine is measured first, in this process, under the same closed loop at each
concurrency (bench/closed_loop.py): the rows the served ones are divided by.
`--dry-run` does the same on a tiny random LFM2 at concurrency 1 and 4 with short requests, for
ours only unless a llama-server and a GGUF are at hand, and prints where llama-server would
come from. Run the full benchmark on a quiet machine: both servers compete for the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import serve_llamacpp as llama  # noqa: E402
from closed_loop import closed_loop  # noqa: E402
from serve_load import Result, pct, stream_one  # noqa: E402
from serve_procs import ours, tree_memory, with_visible_tokens  # noqa: E402

from deployments.serve.serve_run import free_port  # noqa: E402

OFFLINE = "offline engine, same loop"


async def load(url: str, conc: int, requests: int, args: argparse.Namespace) -> dict[str, float]:
    """`conc` closed-loop clients until `requests` streamed completions are done."""
    rng, results = random.Random(args.seed), []
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompts = [[rng.randrange(3, 250) for _ in range(args.prompt_tokens)] for _ in range(requests)]
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while prompts:
            body = {"prompt": prompts.pop(), "max_tokens": args.max_tokens, "temperature": 0.0}
            body.update(ignore_eos=True, model=model)
            results.append(await stream_one(client, "/v1/completions", body, {}))

    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c) for _ in range(conc)))
        wall = time.perf_counter() - t0
    return summarize(results, wall)


def summarize(results: list[Result], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.ok and (r.gaps or r.out_tokens > 1)]
    for r in results:
        if r not in ok:
            why = r.error or f"ok={r.ok} but {len(r.text)} characters of text streamed"
            print(f"#   error: {why}", flush=True)
            break
    gaps = [g for r in ok for g in r.gaps]
    # NOTE: a server that reports no usage still streamed one token per content event.
    out = sum(r.out_tokens or len(r.gaps) + 1 for r in ok)
    return {
        "tok_s": out / wall,
        "tpot_p50": pct([_tpot(r) for r in ok], 0.5),
        "itl_p50": pct(gaps, 0.5),
        "itl_p99": pct(gaps, 0.99),
        "ttft_p50": pct([r.ttft for r in ok if r.ttft is not None], 0.5),
        "errors": float(len(results) - len(ok)),
    }


def _tpot(r: Result) -> float:
    """First to last token over the tokens between them: a server that runs ahead sends a
    backlog as one chunk, so the mean gap between chunks would overstate it."""
    n = r.out_tokens or len(r.gaps) + 1
    return sum(r.gaps) / max(n - 1, 1)


@contextmanager
def theirs(server: Path, gguf: Path, timeout_s: float) -> Iterator[tuple[str, int]]:
    port = free_port()
    cmd = llama.server_command(server, gguf, port, os.cpu_count() or 1, 32)
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"llama-server did not start; see {log.name}")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def measure(name: str, server: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One server: ready time, a warm-up request, then each concurrency; memory after the load."""
    t0 = time.perf_counter()
    with server as (url, pid):
        ready = time.perf_counter() - t0
        asyncio.run(load(url, 1, 1, args))
        rows = []
        for conc in args.concurrency:
            stats = asyncio.run(load(url, conc, max(conc * args.requests_per_client, 2), args))
            rows.append({"server": name, "concurrency": conc, **stats, "ready_s": ready})
        rss, pss = tree_memory(pid)
    for row in rows:
        row["rss_gb"], row["pss_gb"] = rss / 1e9, pss / 1e9
    return rows


def offline_rows(model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The offline engine under the same closed loop at each concurrency (bench/closed_loop.py),
    stepped in this process: what `serve run` would show if its path cost nothing."""
    from shortconv.llm import build_engine

    engine = build_engine(model_dir, dtype="float32")
    try:
        return [
            {
                "server": OFFLINE,
                "concurrency": conc,
                **closed_loop(engine, conc, max(conc * args.requests_per_client, 2), args),
                "errors": 0.0,
            }
            for conc in args.concurrency
        ]
    finally:
        engine.shutdown()


def llama_side(args: argparse.Namespace, model_dir: Path) -> tuple[Path, Path] | None:
    """(llama-server, f32 GGUF), building and converting as needed; None in a dry run that
    lacks either."""
    server, origin = llama.find_server(args.llama_server)
    print(f"# llama-server: {server or '-'} ({origin})", flush=True)
    gguf = Path(args.gguf) if args.gguf else model_dir / "bench-f32.gguf"
    if args.dry_run:
        have_gguf = gguf.is_file() or llama.source_dir().is_dir()
        return (server, llama.convert_f32(model_dir, gguf)) if server and have_gguf else None
    server = server or llama.build_server(os.cpu_count() or 1)
    return server, llama.convert_f32(model_dir, gguf)


def table(rows: list[dict[str, Any]]) -> str:
    head = "| server | concurrency | out tok/s | TPOT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | "
    head += "TTFT p50 (s) | ready (s) | RSS (GB) | PSS (GB) | errors |\n" + "| --- " * 11 + "|"
    lines = [head]
    for r in rows:
        served = "ready_s" in r  # the offline rows have no server to start or measure
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['tok_s']:.1f} | {1e3 * r['tpot_p50']:.0f} "
            f"| {1e3 * r['itl_p50']:.0f} | {1e3 * r['itl_p99']:.0f} | {r['ttft_p50']:.2f} | "
            + (
                f"{r['ready_s']:.1f} | {r['rss_gb']:.2f} | {r['pss_gb']:.2f} | "
                if served
                else "- | - | - | "
            )
            + f"{r['errors']:.0f} |"
        )
    by = {(r["server"], r["concurrency"]): r for r in rows}
    for conc in sorted({r["concurrency"] for r in rows}):
        ref, got = by.get((OFFLINE, conc)), by.get(("shortconv serve run", conc))
        if ref and got:
            lines.append(
                f"\nConcurrency {conc}: serve run / offline engine, TPOT p50 "
                f"{got['tpot_p50'] / ref['tpot_p50']:.2f}x, output tok/s "
                f"{got['tok_s'] / ref['tok_s']:.2f}x."
            )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF checkpoint directory (LFM2); dry run: a tiny random one")
    p.add_argument("--llama-server", help="path to a llama-server binary")
    p.add_argument("--gguf", help="an f32 GGUF of --model (default: converted next to it)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=140)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two servers")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the table here too (markdown)")
    p.add_argument("--dry-run", action="store_true", help="tiny model, short load, ~1 minute")
    p.add_argument("--no-llama", action="store_true", help="offline engine and serve run only")
    # NOTE: diagnosis only: a table for the claim runs at the shipped defaults
    p.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--serve-arg", action="append", default=[], metavar="KEY=YAML")
    args = p.parse_args(argv)
    if args.dry_run:
        args.concurrency, args.requests_per_client, args.rounds = [1, 4], 2, 1
        args.prompt_tokens, args.max_tokens = 32, 16
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.model:
        model_dir = Path(args.model)
    elif args.dry_run:
        from shortconv.tiny.checkpoint import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint("lfm2", Path(tempfile.mkdtemp(prefix="scvs-")), seed=0)
    else:
        raise SystemExit("--model is required (or --dry-run)")
    model_dir = with_visible_tokens(model_dir)
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if "model name" in ln), "?"
    )
    print(f"# {cpu}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}", flush=True)
    side = None if args.no_llama else llama_side(args, model_dir)
    env = dict(kv.split("=", 1) for kv in args.serve_env)
    app: dict[str, object] = {"model": str(model_dir)}
    app.update({k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.serve_arg)})
    if env or len(app) > 1:
        print(f"# serve run, NOT at its defaults: env {env}, args {app}", flush=True)
    rows = offline_rows(model_dir, args)
    for _ in range(args.rounds):
        served = ours(app, args.start_timeout, env or None)
        rows += measure("shortconv serve run", served, args)
        if side is not None:
            rows += measure("llama-server f32", theirs(*side, args.start_timeout), args)
    out = table(rows)
    print(out, flush=True)
    if args.out:
        Path(args.out).write_text(f"CPU: {cpu}\n\n{out}\n")


if __name__ == "__main__":
    main()
