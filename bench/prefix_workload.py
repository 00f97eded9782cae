"""Workload (d), offline: 64 requests sharing a 1,024-token system prompt, each with its own
64-token suffix and 64 output tokens; ours with prefix caching, ours without, transformers.

    .venv/bin/python bench/prefix_workload.py --shape lfm2-350m --runs 1
    .venv/bin/python bench/prefix_workload.py --quick          # seconds (sizes / 8)

All 64 requests are submitted at once (t0). TTFT of a request is t0 -> its first token (ours:
the engine step that emits it). Transformers runs all 64 left-padded in one `generate` call;
its TTFT is t0 -> the end of the prefill forward (every row's first token comes from it),
taken from a `generate` streamer. tokens/s = useful output tokens / wall time of the whole
run. Runs alternate ours-cached, ours-uncached, HF; the cache is flushed before every cached
run, so the first request computes the shared prompt and the others resume from it.
Service side: bench/serve_load.py --shared-prefix (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline import SHAPES, hf_generate, prepare_model  # noqa: E402

from shortconv.llm import LLM  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402

SIZES = {"full": (64, 1024, 64, 64), "quick": (8, 128, 8, 8)}  # requests, system, suffix, out


def make_prompts(vocab: int, n: int, system: int, suffix: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(system)]
    return [shared + [rng.randrange(3, vocab) for _ in range(suffix)] for _ in range(n)]


def ours(llm: LLM, prompts: list[list[int]], out: int) -> dict[str, Any]:
    eng = llm.engine
    eng.flush_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [eng.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    done: dict[str, Any] = {}
    while len(done) < len(rids):
        for o in eng.step():
            first.setdefault(o.request_id, time.perf_counter() - t0)
            if o.finished:
                done[o.request_id] = o
    wall = time.perf_counter() - t0
    outs = [done[r] for r in rids]
    return {
        "wall": wall,
        "ttft": [first[r] for r in rids],
        "tokens": [list(o.token_ids) for o in outs],
        "cached": sum(o.num_cached_tokens for o in outs),
    }


class _FirstToken:
    """A `generate` streamer that notes when the first generated tokens arrive."""

    def __init__(self, t0: float) -> None:
        self.t0, self.calls, self.at = t0, 0, None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.at is None:  # call 1 is the prompt itself
            self.at = time.perf_counter() - self.t0

    def end(self) -> None:
        pass


def hf(model: Any, prompts: list[list[int]], out: int, pad: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    streamer = _FirstToken(t0)
    tokens = hf_generate(model, prompts, out, pad, streamer)
    wall = time.perf_counter() - t0
    return {
        "wall": wall,
        "ttft": [streamer.at or wall] * len(prompts),
        "tokens": tokens,
        "cached": 0,
    }


def pct(values: list[float], q: float) -> float:
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(q * len(vals)))]


def summary(tag: str, runs: list[dict[str, Any]], useful: int) -> float:
    walls = [r["wall"] for r in runs]
    ttft = [t for r in runs for t in r["ttft"]]
    tok_s = useful / statistics.median(walls)
    print(
        f"SUMMARY prefix_workload side={tag} tok_s={tok_s:.1f} ttft_p50_s={pct(ttft, 0.5):.3f} "
        f"ttft_p99_s={pct(ttft, 0.99):.3f} cached_tokens={runs[-1]['cached']} "
        f"wall_s={' '.join(f'{w:.2f}' for w in walls)}",
        flush=True,
    )
    return statistics.median(walls)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="lfm2-350m")
    p.add_argument("--model", help="a checkpoint directory instead of --shape")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--vs", choices=["hf", "none"], default="hf")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--ckpt-dir")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.shape = "lfm2-tiny" if not args.model else args.shape
    torch.set_num_threads(args.threads)
    n, system, suffix, out = SIZES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, name = prepare_model(args, tmp)
        kw: dict[str, Any] = {"max_num_seqs": n, "dtype": "float32"}
        cached_llm = LLM(model_dir, **kw)
        plain_llm = LLM(model_dir, enable_prefix_caching=False, **kw)
        cfg = cached_llm.engine.model_cfg
        prompts = make_prompts(cfg.vocab_size, n, system, suffix, args.seed)
        model, pad = None, cfg.raw.get("pad_token_id") or 0
        if args.vs == "hf":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        print(
            f"# prefix_workload {name}: {n} requests, system {system} + suffix {suffix}, "
            f"{out} new tokens; threads {torch.get_num_threads()}; "
            f"load avg {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        warm = prompts[:2]
        ours(cached_llm, warm, 4), ours(plain_llm, warm, 4)
        sides: dict[str, list[dict[str, Any]]] = {"cached": [], "uncached": [], "hf": []}
        for _ in range(args.runs):
            sides["cached"].append(ours(cached_llm, prompts, out))
            sides["uncached"].append(ours(plain_llm, prompts, out))
            if model is not None:
                sides["hf"].append(hf(model, prompts, out, pad))
        useful = n * out
        walls = {k: summary(k, v, useful) for k, v in sides.items() if v}
        pairs = zip(sides["cached"][-1]["tokens"], sides["uncached"][-1]["tokens"], strict=True)
        same = sum(a == b for a, b in pairs)
        speedup = walls["uncached"] / walls["cached"]
        line = f"SUMMARY prefix_workload ratio cached/uncached={speedup:.2f}"
        if "hf" in walls:
            line += f" cached/hf={walls['hf'] / walls['cached']:.2f}"
        print(f"{line} greedy_agreement_cached_vs_uncached={same / n:.2f}", flush=True)
        cached_llm.shutdown()
        plain_llm.shutdown()


if __name__ == "__main__":
    main()
