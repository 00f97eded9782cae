"""What the engine's CPU priority takes under load: batch-1 decode tokens/s of an offline
engine at Ray's worker niceness (15) and at the core process's default (0, `engine_niceness`),
alone and beside busy nice-0 processes (one per core: a load generator, another tenant).

    .venv/bin/python bench/priority.py --shape lfm2-350m

Each case runs in a fresh child process that sets its niceness before torch starts its thread
pool (threads inherit it), builds the engine, and decodes; the cases alternate over rounds.
Lowering niceness below the parent's needs CAP_SYS_NICE (root): the bench says so and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import os, sys, json, time
os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[2]))
sys.path[:0] = [sys.argv[4], sys.argv[4] + "/bench"]
import torch
torch.set_num_threads(int(sys.argv[3]))
from shortconv.llm import LLM
from shortconv.sampling.sampling_params import SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=1)
prompt = [[5 + i % 200 for i in range(32)]]
def run(n):
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t0
run(4)
n = int(sys.argv[5])
print(json.dumps({"tok_s": n / (run(n + 1) - run(1))}))
"""


def decode_rate(ckpt: Path, nice: int, threads: int, tokens: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(ckpt), str(nice), str(threads), str(ROOT), str(tokens)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tok_s"])


def main() -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    from offline import SHAPES

    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="lfm2-350m", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if os.getpriority(os.PRIO_PROCESS, 0) > 0 and os.geteuid() != 0:
        sys.exit("running niced without CAP_SYS_NICE: the nice-0 case cannot be set up here")
    arch, overrides = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(arch, Path(tmp) / "ckpt", overrides, seed=0)
        cases = [("alone", 15, 0), ("beside hogs", 15, args.hogs), ("beside hogs", 0, args.hogs)]
        rates: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for name, nice, hogs in cases:
                procs = [
                    subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(hogs)
                ]
                try:
                    rate = decode_rate(ckpt, nice, args.threads, args.tokens)
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                rates.setdefault((name, nice), []).append(rate)
    print(f"# shape {args.shape}; threads {args.threads}; {args.hogs} nice-0 busy processes")
    print("| case | engine nice | decode tok/s (median) | vs alone |")
    print("| --- | --- | --- | --- |")
    alone = statistics.median(rates[("alone", 15)])
    for (name, nice), r in rates.items():
        med = statistics.median(r)
        print(f"| {name} | {nice} | {med:.1f} | {med / alone:.2f}x |")


if __name__ == "__main__":
    main()
