"""int4's batch-1 decode step under each choice of the q6 layers, side by side in one process:
the LM head q8 or q6, and Q4_K_M's ffn_down layers q4 or q6 (`layers.linear_binding`'s
LM_HEAD_QUANTIZED and INT4_Q6_FFN_DOWN, read when an engine binds its methods). Each variant is
its own engine over the same checkpoint; rounds alternate between them, so drift on a shared
VM lands on every variant alike. Prints ms a decode step (wall), median and each round.

    .venv/bin/python bench/int4_layout_ab.py --model /path/to/lfm2-350m [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import shortconv.layers.linear_binding as binding  # noqa: E402
from shortconv.layers.quantize import Q6Linear, Q8Linear  # noqa: E402

# profile_step's engine and prefill, so both benches decode the same way.
_spec = importlib.util.spec_from_file_location("profile_step", ROOT / "bench" / "profile_step.py")
assert _spec is not None and _spec.loader is not None
profile_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_step)

VARIANTS = {
    "q8 head, q4 ffn_down": (Q8Linear, False),
    "q6 head, q4 ffn_down": (Q6Linear, False),
    "q8 head, q6 ffn_down": (Q8Linear, True),
    "q6 head, q6 ffn_down (default)": (Q6Linear, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=48, help="decode steps a round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    opts = argparse.Namespace(
        quantization="int4", runs=1, steps=64, context=32, py_spy=None, cprofile=None
    )
    head, ffn_down = binding.LM_HEAD_QUANTIZED["int4"], binding.INT4_Q6_FFN_DOWN
    engines = {}
    try:
        for name, (head_method, q6_down) in VARIANTS.items():
            binding.LM_HEAD_QUANTIZED["int4"], binding.INT4_Q6_FFN_DOWN = head_method, q6_down
            llm = profile_step.make_llm(args.model, False, opts)
            budget = (args.rounds + 1) * args.steps + 16
            profile_step.prefill(llm, 1, 32, budget, llm.engine.model_cfg.vocab_size)
            for _ in range(8):  # warm
                llm.engine.step()
            engines[name] = llm
    finally:
        binding.LM_HEAD_QUANTIZED["int4"], binding.INT4_Q6_FFN_DOWN = head, ffn_down
    ms: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                llm.engine.step()
            ms[name].append((time.perf_counter() - start) / args.steps * 1e3)
    base = statistics.median(ms["q8 head, q4 ffn_down"])
    print(f"# int4 batch 1, {args.threads} threads, {args.rounds} rounds of {args.steps} steps")
    for name, runs in ms.items():
        med = statistics.median(runs)
        each = " ".join(f"{r:.2f}" for r in runs)
        print(f"{name:32s} {med:6.2f} ms a step ({med / base:.3f}x)  rounds {each}")


if __name__ == "__main__":
    main()
