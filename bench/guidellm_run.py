"""guidellm 0.8.1 (the vLLM project's benchmark tool) against `serve run deployments/lfm2.yaml`.

    .venv/bin/python bench/guidellm_run.py                       # tiny LFM2, chat, 16 requests
    .venv/bin/python bench/guidellm_run.py --requests 32 --streams 4 --route /v1/completions

guidellm lives in a venv of its own (GUIDELLM_VENV, default under the temp dir; it pulls torch
and datasets, which must not touch the project's venv) and is installed there when absent. The
service runs as `serve run` of the shipped YAML in its own process group (its tiny random
checkpoint, whose tokenizer guidellm counts tokens with). Two runs: `synchronous` (one request
at a time) and `concurrent` (`--streams` at once), each `--requests` requests of synthetic
text (`--prompt-tokens` in, `--output-tokens` out, streamed, as guidellm sends by default).
Printed: per run, successful / errored / incomplete requests, request rate, output tokens/s,
TTFT and ITL medians, from guidellm's JSON report; exit status 1 when any request errored.
Not part of the test suite (a few minutes); tests/deployments/test_serve_openai_api.py replays
the request bodies guidellm sends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deployments.frontend.config.model_source import tiny_checkpoint  # noqa: E402
from deployments.serve.serve_run import serve_run  # noqa: E402

GUIDELLM = "guidellm==0.8.1"


def guidellm_bin() -> Path:
    venv = Path(os.environ.get("GUIDELLM_VENV", Path(tempfile.gettempdir()) / "guidellm-venv"))
    exe = venv / "bin" / "guidellm"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", GUIDELLM], check=True)
    return exe


def run_one(exe: Path, url: str, model: str, args: argparse.Namespace, profile: str) -> Any:
    out = Path(tempfile.mkdtemp(prefix="guidellm-")) / f"{profile}.json"
    data = f"kind=synthetic_text,prompt_tokens={args.prompt_tokens}"
    data += f",output_tokens={args.output_tokens}"
    prof = (
        "kind=synchronous"
        if profile == "synchronous"
        else f"kind=concurrent,streams={args.streams}"
    )
    cmd = [
        str(exe), "run",
        "--backend", f"kind=openai_http,target={url},model={model},request_format={args.route}",
        "--tokenizer", f"kind=huggingface_auto,model={tiny_checkpoint('lfm2', 0)}",
        "--data", data,
        "--profile", prof,
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--output", f"kind=json,path={out}",
        "--disable-progress",
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.read_text())


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The numbers that matter from guidellm's JSON report (its schema, 0.8.1)."""
    bench = report["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    m = bench["metrics"]
    return {
        "successful": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        "requests_per_s": m["requests_per_second"]["successful"]["mean"],
        "output_tokens_per_s": m["output_tokens_per_second"]["successful"]["mean"],
        "ttft_ms_median": m["time_to_first_token_ms"]["successful"]["median"],
        "itl_ms_median": m["inter_token_latency_ms"]["successful"]["median"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--route", default="/v1/chat/completions")
    args = p.parse_args()
    exe = guidellm_bin()
    config = yaml.safe_load((ROOT / "deployments" / "lfm2.yaml").read_text())
    failed = False
    with serve_run(config, 300.0) as (url, _):
        model = "tiny-lfm2"
        for profile in ("synchronous", "concurrent"):
            got = summary(run_one(exe, url, model, args, profile))
            print(profile, json.dumps(got), flush=True)
            failed |= got["errored"] > 0 or got["successful"] < args.requests
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
