"""Decode speed of `quantization` against the unquantized engine, side by side in one run.

    .venv/bin/python bench/quant_speed.py --shape lfm2-350m --threads 2

Three engines load the same random checkpoint: fp32 on torch's own linears (`cpu_kernels`
off, the code before kernels/cpu_gemm), fp32 with them (the default), and the quantized one;
rounds alternate between them. Decode tokens/s
at 1, 8 and 32 parallel requests (32-token prompts): a request's decode time is its run with
65 output tokens less its run with 1 (the prefill and first token), so prefill is not counted.
The step budget is a batch job's (every prompt prefilled before decode starts), not the
streams-first default, which would mix prefill into the decode steps measured.
The batch-1 memory floor is the weights read per token over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from offline import SHAPES  # noqa: E402

from shortconv.llm import LLM  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402

PROMPT, DECODE = 32, 64


def copy_bandwidth(nbytes: int = 1 << 28) -> float:
    """Bytes/s of a large tensor copy (read + write counted), best of 5."""
    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def decode_seconds(llm: LLM, batch: int, seed: int) -> float:
    rng = random.Random(seed)
    vocab = llm.engine.model_cfg.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT)] for _ in range(batch)]

    def run(n: int) -> float:
        llm.engine.flush_prefix_cache()
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=p)
        return time.perf_counter() - t0

    return run(DECODE + 1) - run(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="lfm2-350m", choices=sorted(SHAPES))
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument(
        "--float-head", action="store_true", help="also the quantized body with an fp32 LM head"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    arch, overrides = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(arch, Path(tmp) / "ckpt", overrides, seed=0)
        variants = {
            "fp32, torch linears": {"cpu_kernels": False},
            "none": {},
            args.quantization: {"quantization": args.quantization},
        }
        if args.float_head:
            variants[f"{args.quantization}, fp32 LM head"] = {
                "quantization": args.quantization,
                "quantize_lm_head": False,
            }
        llms = {
            q: LLM(
                path,
                dtype="float32",
                max_num_seqs=max(batches),
                max_num_batched_tokens=PROMPT * max(batches),
                max_prefill_tokens_while_decoding=PROMPT * max(batches),
                **kw,
            )
            for q, kw in variants.items()
        }
        weights = {
            q: sum(llm.engine.executor.runner.weight_bytes.values()) for q, llm in llms.items()
        }
        times: dict[tuple[str, int], list[float]] = {}
        for b in batches:
            for llm in llms.values():
                decode_seconds(llm, b, seed=99)  # warm-up
            for r in range(args.rounds):
                for q, llm in llms.items():
                    times.setdefault((q, b), []).append(decode_seconds(llm, b, seed=r))
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s; threads {args.threads}; shape {args.shape}")
    print("| weights | bytes | batch | decode tok/s | vs none | batch-1 floor tok/s | of floor |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b in batches:
        base = b * DECODE / statistics.median(times[("none", b)])
        for q in llms:
            rate = b * DECODE / statistics.median(times[(q, b)])
            floor = bw / weights[q]
            of_floor = f"{rate / floor:.0%}" if b == 1 else ""
            print(
                f"| {q} | {weights[q] / 1e6:.0f} MB | {b} | {rate:.1f} | {rate / base:.2f}x | "
                f"{floor:.1f} | {of_floor} |"
            )


if __name__ == "__main__":
    main()
