"""Where a verify step's extra time goes, against a decode step, at batch 1.

    .venv/bin/python bench/spec_profile.py --shape lfm2-350m --threads 2 --quantization int8 --k 4

One request, the 128-token prompt of bench/spec_decode.py, then `--steps` decode steps
(speculation off) and `--steps` verify steps of exactly k + 1 tokens (proposals forced to the
request's last k tokens) under `torch.profiler`, in one process. Prints self CPU time per step
by bucket: the GEMMs (linear layers, int8 tiles included), the LM head (`compute_logits`),
sampling (`sample_step`), and the rest (Python, indexing, conv and attention kernels), so the
verify step's extra time is split between them. Ratios only: the machine is shared.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from offline import SHAPES  # noqa: E402
from spec_decode import PROMPT, _engine, _force_proposals, _greedy  # noqa: E402

from shortconv.execution import runner as runner_mod  # noqa: E402
from shortconv.llm import LLM  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402

BUCKETS = ("lm_head", "sampling")


def _label(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def wrapped(*a: Any, **kw: Any) -> Any:
        with record_function(name):
            return fn(*a, **kw)

    return wrapped


def _instrument(llm: LLM) -> None:
    """Label the LM head and the step's sampling so the profile can split them out."""
    model = llm.engine.executor.runner.model  # type: ignore[attr-defined]
    model.compute_logits = _label(model.compute_logits, "lm_head")


def profiled_steps(llm: LLM, prompt: list[int], steps: int, speculative: bool) -> dict[str, Any]:
    """ms per step: wall, and self CPU time by bucket."""
    eng = llm.engine
    eng.flush_prefix_cache()
    eng.add_request(prompt, _greedy(steps * 16, speculative))
    eng.step()
    eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = time.perf_counter() - t0
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)
    out: dict[str, Any] = {"wall": wall * 1e3 / steps}
    events = prof.key_averages()
    for name in BUCKETS:
        out[name] = sum(e.cpu_time_total for e in events if e.key == name) / 1e3 / steps
    gemm = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul")
    out["gemm_self"] = (
        sum(e.self_cpu_time_total for e in events if e.key in gemm or "gemm" in e.key.lower())
        / 1e3
        / steps
    )
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    out["top"] = [(e.key, e.self_cpu_time_total / 1e3 / steps) for e in top]
    return out


def step_args(doc: str, quant: tuple[str, str]) -> argparse.Namespace:
    """The verify-step benches' arguments (this one and bench/spec_verify_ab.py); `quant`:
    the weights option's name and default. Sets torch's thread count."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--shape", default="lfm2-350m", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(f"--{quant[0]}", default=quant[1])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time steps by process CPU time (with --threads 1: the step's own work, not the "
        "time it waited for a core on a loaded machine)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = step_args(__doc__, ("quantization", "int8"))
    runner_mod.sample_step = _label(runner_mod.sample_step, "sampling")
    arch, overrides = SHAPES[args.shape]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(arch, Path(tmp) / "ckpt", overrides, seed=0)
        kw = {} if args.quantization == "none" else {"quantization": args.quantization}
        llm = _engine(path, args.k, **kw)
        _force_proposals(llm, args.k)
        _instrument(llm)
        vocab = llm.engine.model_cfg.vocab_size
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT)]
        # Alternate, and keep each kind's fastest round: the machine is shared, and load only
        # ever adds time.
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for spec in (False, True):
                runs[spec].append(profiled_steps(llm, prompt, args.steps, spec))
        llm.shutdown()
        dec, ver = (min(runs[s], key=lambda r: r["wall"]) for s in (False, True))
    print(f"# {args.shape}, {args.quantization}, k = {args.k}, ms per step (profiled)")
    print("| bucket | decode | verify | extra |")
    print("| --- | --- | --- | --- |")
    for key in ("wall", "gemm_self", *BUCKETS):
        print(f"| {key} | {dec[key]:.2f} | {ver[key]:.2f} | {ver[key] - dec[key]:+.2f} |")
    for name, d in (("decode", dec), ("verify", ver)):
        print(f"\ntop self CPU ops, {name}:")
        for key, ms in d["top"]:
            print(f"  {ms:7.2f} ms  {key}")


if __name__ == "__main__":
    main()
