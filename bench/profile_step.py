"""Decode-step profile of the engine on CPU: where a step's time goes, and A/B of a switch.

    .venv/bin/python bench/profile_step.py --shape lfm2-tiny --batch 1       # overhead share
    .venv/bin/python bench/profile_step.py --shape lfm2-350m --batch 32 --compare graphs
    .venv/bin/python bench/profile_step.py --shape lfm2-350m --batch 32 --compare onednn
    .venv/bin/python bench/profile_step.py --shape lfm2-350m --batch 32 --compare prepack
    .venv/bin/python bench/profile_step.py --shape lfm2-tiny --py-spy out.svg  # flame graph
    .venv/bin/python bench/profile_step.py --shape lfm2-350m --quantization int4 --threads 2 \
        --cprofile 25                                    # top host functions, ms per step

Each engine prefills `--batch` requests of `--context` tokens once (not timed); a run then
times the next `--steps` decode steps of `LLMEngine.step()` (the context grows by `--steps`
per run). "forward" is the time inside the model's forward and
LM head (timed by hooks, end to end on CPU where every op is synchronous); "overhead" is the
rest of the step: scheduling, plan, step tensors / static buffers, sampling, detokenizing.
"cpu_ms" is the process CPU time of a step (time.process_time over all threads, so with
`--threads 2` it counts both GEMM threads): on a loaded machine it moves less than wall time.
`--cprofile N` runs one more set of steps under cProfile and prints the N functions with the
most own process CPU time, in ms per step (cProfile's own cost inflates Python-heavy items).
`--compare` runs variant A and B interleaved (A/B/A/B after a warm-up) and prints the ratio
of medians: `graphs` = EngineConfig.enable_graphs True vs False (two engines, same weights
file), `onednn` = large CPU linears through oneDNN vs F.linear (one engine), `prepack` =
EngineConfig.prepack_cpu_weights True vs False (two engines).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import offline  # noqa: E402

from shortconv.layers import linear_float  # noqa: E402
from shortconv.llm import LLM  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402


class ForwardTimer:
    """Accumulates wall time inside model.forward and model.compute_logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total = 0.0
        self._t0 = 0.0
        model.register_forward_pre_hook(lambda *_: self._start())
        model.register_forward_hook(lambda *_: self._stop())
        logits = model.compute_logits

        def timed_logits(h: torch.Tensor) -> torch.Tensor:
            self._start()
            try:
                return logits(h)
            finally:
                self._stop()

        model.compute_logits = timed_logits  # type: ignore[method-assign]

    def _start(self) -> None:
        self._t0 = time.perf_counter()

    def _stop(self) -> None:
        self.total += time.perf_counter() - self._t0


def prefill(llm: LLM, batch: int, context: int, max_tokens: int, vocab: int) -> None:
    """Queue `batch` requests and run until every prompt is computed (not timed)."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        eng.add_request([3 + (i * 31 + j * 7) % (vocab - 3) for j in range(context)], params)
    while eng.scheduler.waiting or any(
        r.num_computed < len(r.prompt_token_ids) for r in eng.scheduler.running
    ):
        eng.step()


def decode_steps(llm: LLM, timer: ForwardTimer, steps: int) -> tuple[float, float, float]:
    """Seconds per decode step (whole step wall, inside forward wall, whole step process CPU)
    over the next `steps` steps."""
    timer.total = 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall / steps, timer.total / steps, cpu / steps


def profile_top(llm: LLM, timer: ForwardTimer, steps: int, top: int) -> None:
    """cProfile `steps` decode steps; print the `top` functions by own process CPU time, ms per
    step (CPU, not wall: on a loaded machine wall time charges preemption to whatever ran)."""
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    decode_steps(llm, timer, steps)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"# cProfile over {steps} steps: own ms/step, cumulative ms/step, calls/step, function")
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{Path(file).name}:{line}" if line else file
        print(
            f"#  {tottime * 1e3 / steps:7.3f} {cumtime * 1e3 / steps:8.3f} "
            f"{ncalls / steps:7.1f}  {fn} ({where})"
        )


def budget(args: argparse.Namespace) -> tuple[int, int]:
    """(decode steps each request must allow, longest context): every variant sharing an engine
    and the optional py-spy run decode the same requests."""
    steps = ((args.runs + 1) * args.steps + 4) * (2 + bool(args.py_spy) + bool(args.cprofile))
    return steps, args.context + steps + 16


def make_llm(model_dir: Path, graphs: bool, args: argparse.Namespace, prepack: bool = False) -> LLM:
    """An engine for `model_dir`. NOTE: `prepack` off unless asked, as in the engine's own
    default (EngineConfig.prepack_cpu_weights), so a plain run profiles the served path."""
    from shortconv.configs.config import ModelConfig

    longest = budget(args)[1]
    if longest > ModelConfig.from_dir(model_dir).max_model_len:
        raise SystemExit(f"context + steps need {longest} positions: use fewer --steps/--runs")
    return LLM(
        model_dir,
        dtype="float32",
        enable_graphs=graphs,
        max_num_seqs=64,
        max_model_len=max(256, longest),
        prepack_cpu_weights=prepack,
        quantization=args.quantization,
    )


def variants(args: argparse.Namespace, model_dir: Path) -> dict[str, tuple[LLM, Any]]:
    """name -> (engine, setter called before each of its runs)."""
    if args.compare == "graphs":
        on, off = (make_llm(model_dir, g, args) for g in (True, False))
        return {"graphs_on": (on, None), "graphs_off": (off, None)}
    if args.compare == "prepack":
        on, off = (make_llm(model_dir, args.graphs == "on", args, p) for p in (True, False))
        return {"prepacked": (on, None), "plain": (off, None)}
    if args.compare == "onednn":
        # Read when the linear methods are bound (build): the second engine keeps F.linear.
        default = linear_float.ONEDNN_MIN_WEIGHT
        on = make_llm(model_dir, args.graphs == "on", args)
        linear_float.ONEDNN_MIN_WEIGHT = 1 << 62
        try:
            off = make_llm(model_dir, args.graphs == "on", args)
        finally:
            linear_float.ONEDNN_MIN_WEIGHT = default
        return {"onednn": (on, None), "f_linear": (off, None)}
    llm = make_llm(model_dir, args.graphs == "on", args)
    return {"engine": (llm, None)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model")
    src.add_argument("--shape", choices=sorted(offline.SHAPES), default="lfm2-tiny")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--graphs", choices=["on", "off"], default="off")
    p.add_argument("--compare", choices=["none", "graphs", "onednn", "prepack"], default="none")
    p.add_argument("--ckpt-dir")
    p.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    p.add_argument("--py-spy", metavar="SVG", help="record a flame graph of one run")
    p.add_argument("--cprofile", type=int, metavar="N", help="print the top N host functions")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        args.seed, args.quick = 0, False
        model_dir, name = offline.prepare_model(args, tmp)
        run(args, model_dir, name)


def run(args: argparse.Namespace, model_dir: Path, name: str) -> None:
    vs = variants(args, model_dir)
    timers = {k: ForwardTimer(llm.engine.executor.runner.model) for k, (llm, _) in vs.items()}
    vocab = next(iter(vs.values()))[0].engine.model_cfg.vocab_size
    print(
        f"# profile_step {name}: batch {args.batch}, context {args.context}, "
        f"{args.steps} steps x {args.runs} runs, threads {torch.get_num_threads()}, "
        f"load avg {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    engines = {id(llm): llm for llm, _ in vs.values()}
    for llm in engines.values():  # one prefill per engine; every run below decodes on
        prefill(llm, args.batch, args.context, budget(args)[0], vocab)
    if args.py_spy:
        key, (llm, _) = next(iter(vs.items()))
        spy = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "-o",
                args.py_spy,
                "-r",
                "200",
                "-p",
                str(os.getpid()),
            ]
        )
        time.sleep(1.0)
        decode_steps(llm, timers[key], (args.runs + 1) * args.steps)
        spy.terminate()
        spy.wait()
    res: dict[str, list[tuple[float, float, float]]] = {k: [] for k in vs}
    for r in range(args.runs + 1):  # run 0 is the warm-up
        for key, (llm, setter) in vs.items():
            if setter is not None:
                setter()
            m = decode_steps(llm, timers[key], args.steps)
            if r:
                res[key].append(m)
    med = {}
    for key, ms in res.items():
        step = statistics.median(s for s, _, _ in ms)
        fwd = statistics.median(f for _, f, _ in ms)
        cpu = statistics.median(c for _, _, c in ms)
        med[key] = step
        print(
            f"SUMMARY profile_step shape={name} variant={key} batch={args.batch} "
            f"step_ms={step * 1e3:.3f} forward_ms={fwd * 1e3:.3f} "
            f"overhead_pct={100 * (step - fwd) / step:.1f} cpu_ms={cpu * 1e3:.3f} "
            f"runs_ms={','.join(f'{s * 1e3:.2f}' for s, _, _ in ms)}",
            flush=True,
        )
    if args.cprofile:
        key, (llm, _) = next(iter(vs.items()))
        profile_top(llm, timers[key], args.steps, args.cprofile)
    if len(med) == 2:
        (ka, a), (kb, b) = med.items()
        print(
            f"SUMMARY profile_step compare {ka}/{kb} speedup={b / a:.2f} "
            f"load_avg={os.getloadavg()[0]:.2f}"
        )


if __name__ == "__main__":
    main()
