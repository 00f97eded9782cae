"""What Ray Serve costs before any code of ours runs: `serve run` of an app of the same shape as
ours (an HTTP ingress deployment streaming from a second deployment through a handle) that
computes nothing. Its time to ready, its memory, and the CPU its processes use per streamed
chunk are the floor under `serve run deployments/lfm2.yaml` on this machine (issue 45's "ready
in at most 12 s", "PSS at most 1.5x llama-server's", "0.95x the offline engine").

    .venv/bin/python bench/serve_floor.py --repeats 3 --chunks 128 --interval-ms 58

`--interval-ms` paces the backend's chunks like the offline engine's decode steps (it sleeps,
so the CPU counted is the relay's alone: backend, ingress, proxy, and Ray's own processes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:  # the app half: imported by `serve run` in Ray's workers, where Ray is present
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Backend:
        async def stream(self, chunks: int, interval_s: float) -> AsyncIterator[str]:
            for i in range(chunks):
                await asyncio.sleep(interval_s)
                yield f"t{i} "

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Ingress:
        def __init__(self, backend: Any) -> None:
            self.backend = backend.options(stream=True)

        async def __call__(self, request: Request) -> Any:
            if request.url.path == "/v1/models":
                return JSONResponse({"object": "list", "data": []})
            q = request.query_params
            gen = self.backend.stream.remote(int(q["chunks"]), float(q["interval_s"]))

            async def sse() -> AsyncIterator[str]:
                async for piece in gen:
                    yield f"data: {json.dumps({'text': piece})}\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

    app = Ingress.bind(Backend.bind())
except ImportError:  # pragma: no cover - the bench half needs Ray too
    pass


def config() -> dict[str, Any]:
    return {
        "applications": [
            {
                "name": "floor",
                "route_prefix": "/",
                "import_path": "serve_floor:app",
                "runtime_env": {"env_vars": {"PYTHONPATH": str(ROOT / "bench")}},
            }
        ]
    }


def stream_once(url: str, chunks: int, interval_s: float) -> int:
    import httpx

    got = 0
    params = {"chunks": chunks, "interval_s": interval_s}
    with httpx.stream("GET", f"{url}/stream", params=params, timeout=600) as r:
        for line in r.iter_lines():
            got += line.startswith("data: ")
    return got


def one_start(args: argparse.Namespace) -> dict[str, Any]:
    from serve_procs import cpu_snapshot, cpu_used, processes, tree_memory

    from deployments.serve.serve_run import serve_run

    t0 = time.monotonic()
    with serve_run(config(), args.timeout) as (url, log):
        ready_s = time.monotonic() - t0
        cfg = str(log.parent / "serve.yaml")
        pid = next(p for p, (_, cmd) in processes().items() if cfg in cmd)
        time.sleep(2.0)  # let the start's stragglers settle before counting
        rss, pss = tree_memory(pid, show_mb=1e9)
        stream_once(url, 4, 0.0)  # warm the path
        before = cpu_snapshot(pid)
        t1 = time.monotonic()
        got = stream_once(url, args.chunks, args.interval_ms / 1000.0)
        wall = time.monotonic() - t1
        used = cpu_used(before, pid)
    per_chunk: dict[str, float] = {}
    for s, name in used:  # summed by command (Ray's workers share their interpreter's path)
        key = name.split()[0].rsplit("/", 1)[-1][:40]
        per_chunk[key] = per_chunk.get(key, 0.0) + 1000.0 * s / max(got, 1)
    return {
        "ready_s": ready_s,
        "rss_gb": rss / 1e9,
        "pss_gb": pss / 1e9,
        "chunks": got,
        "wall_s": wall,
        "cpu_ms_per_chunk": sum(per_chunk.values()),
        "by_process": per_chunk,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunks", type=int, default=128)
    p.add_argument("--interval-ms", type=float, default=58.0)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    runs = []
    for i in range(args.repeats):
        runs.append(one_start(args))
        r = runs[-1]
        print(
            f"# run {i + 1}: ready {r['ready_s']:.1f} s, RSS {r['rss_gb']:.2f} GB, "
            f"PSS {r['pss_gb']:.2f} GB, relay CPU {r['cpu_ms_per_chunk']:.2f} ms a chunk",
            flush=True,
        )
    best = min(runs, key=lambda r: r["ready_s"])
    print("| ready (s), best / median | PSS (GB) | relay CPU per chunk (ms), median |")
    print("| --- | --- | --- |")
    print(
        f"| {best['ready_s']:.1f} / {statistics.median(r['ready_s'] for r in runs):.1f} | "
        f"{statistics.median(r['pss_gb'] for r in runs):.2f} | "
        f"{statistics.median(r['cpu_ms_per_chunk'] for r in runs):.2f} |"
    )
    print("relay CPU per chunk by process (last run):")
    for name, ms in sorted(runs[-1]["by_process"].items(), key=lambda kv: -kv[1]):
        print(f"  {ms:6.2f} ms  {name}")


if __name__ == "__main__":
    main()
