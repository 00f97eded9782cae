"""Verify-step cost against a decode step, with and without the CPU verify-row conv path, in
one process (A/B on a shared machine).

    .venv/bin/python bench/spec_verify_ab.py --shape lfm2-350m --threads 2 --quantizations none,int8

One engine per weight kind, one request with the 128-token prompt of bench/spec_decode.py;
rounds alternate decode steps (speculation off), verify steps of exactly k + 1 tokens with
the short conv's equal-rows CPU path (`kernels/conv1d_verify_cpu.py`, the default), and the
same verify steps with the layers bound to the reference (`conv1d_ref.causal_conv1d_fn_ref`,
what every verify step ran before). Prints the lower quartile of each kind's step times (load
only adds time) and each verify kind's ratio to the decode step.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from offline import SHAPES  # noqa: E402
from spec_decode import PROMPT, _engine, _force_proposals, step_times  # noqa: E402

import shortconv.layers.short_conv as short_conv  # noqa: E402
from shortconv.kernels.conv1d_ref import causal_conv1d_fn_ref  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402


def _q25(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 4]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="lfm2-350m", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantizations", default="none,int8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    arch, overrides = SHAPES[args.shape]
    fast = short_conv.causal_conv1d_fn
    rng = random.Random(0)
    print(f"# {args.shape}, threads {args.threads}, k = {args.k}; step ms (lower quartile)")
    print("| weights | decode | verify, ref conv | verify, verify-row conv |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(arch, Path(tmp) / "ckpt", overrides, seed=0)
        for q in args.quantizations.split(","):
            llm = _engine(path, args.k, **({} if q == "none" else {"quantization": q}))
            _force_proposals(llm, args.k)
            vocab = llm.engine.model_cfg.vocab_size
            prompt = [rng.randrange(3, vocab) for _ in range(PROMPT)]
            times: dict[str, list[float]] = {"decode": [], "ref": [], "fast": []}
            for r in range(args.rounds + 1):
                for kind in times:
                    short_conv.causal_conv1d_fn = causal_conv1d_fn_ref if kind == "ref" else fast
                    got = step_times(llm, prompt, args.steps, kind != "decode")
                    if r:  # round 0 warms up
                        times[kind] += got
            short_conv.causal_conv1d_fn = fast
            llm.shutdown()
            d, ref, new = (_q25(times[k]) * 1e3 for k in ("decode", "ref", "fast"))
            print(f"| {q} | {d:.1f} | {ref:.1f} ({ref / d:.2f}x) | {new:.1f} ({new / d:.2f}x) |")


if __name__ == "__main__":
    main()
