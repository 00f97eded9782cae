"""Decode-step latency: graph replay vs eager, per batch size, printed side by side.

    PYTHONPATH=. python bench/decode_step.py            # GPU: LFM2-350M and ZAYA1 shapes
    PYTHONPATH=. python bench/decode_step.py --quick    # CPU smoke run on a tiny config
    PYTHONPATH=. python bench/decode_step.py --warmup   # GPU: compile the kernels, shallow models
    PYTHONPATH=. python bench/decode_step.py --dry-run  # import what the GPU run imports, exit

Random weights at the real widths (shortconv.tiny.random_stack); no checkpoint, no
transformers, no Ray. Every row decodes one token at context `--context` from its own slot
and pages. "eager" is the engine's eager step (resolve the plan, run the model); "graph" is
GraphRunner.run (refresh the static buffers, snapshot the step's state, replay). Neither
includes the LM head, which both paths run the same way. On CPU a "replay" is the same forward
on padded static buffers, so the ratio there only shows the protocol's overhead.
Target: graph replay >= 3x faster than eager at batch 1 for the LFM2-350M shape.

Capture. `SUMMARY capture` reports how many graphs were captured, over which context buckets,
and in how long. On the paged (Triton) path that is one context bucket, the model's
max_model_len; the former layout (one context bucket of `--context`) is captured next to it
for the first model and replayed on the same plans (`SUMMARY decode_bucket`), so the single
wide bucket's cost per replay at a short context is measured, not assumed.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.engine.plan import SeqChunk, StepPlan  # noqa: E402
from shortconv.execution.backend import ShortConvBackend  # noqa: E402
from shortconv.execution.graph_runner import GraphRunner  # noqa: E402
from shortconv.kernels.dispatch import resolve_backend  # noqa: E402
from shortconv.tiny.random_stack import LFM2_350M, ZAYA1_BASE, build_random_stack  # noqa: E402

TINY_LFM2: dict[str, Any] = {
    **LFM2_350M,
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "full_attn_idxs": [2],
    "block_ff_dim": 128,
    "block_auto_adjust_ff_dim": False,
    "max_position_embeddings": 1024,
}
PAGE = 16
GRAPH_TARGET = 3.0
# NOTE: what the GPU run imports beyond the top of this file (through the model's layers);
# --dry-run imports exactly these.
GPU_IMPORTS = (
    "triton",
    "shortconv.models.zaya1",
    "shortconv.kernels.conv1d_triton",
    "shortconv.kernels.cca_triton",
    "shortconv.kernels.attention_triton",
    "shortconv.kernels.moe_triton",
)


def decode_plan(batch: int, context: int) -> StepPlan:
    pages = -(-context // PAGE)
    seqs = tuple(
        SeqChunk(
            f"r{i}",
            (i % 500 + 1,),
            context - 1,
            1 + i,
            tuple(range(1 + i * pages, 1 + (i + 1) * pages)),
            None,
        )
        for i in range(batch)
    )
    return StepPlan(0, seqs)


def _time(fn: Any, iters: int, sync: Any) -> float:
    """Median wall time of one call in ms (synchronised: host overhead is what graphs cut)."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_model(
    name: str,
    raw: dict[str, Any],
    batches: list[int],
    context: int,
    device: str,
    dtype: torch.dtype,
    iters: int,
    compare_former: bool = False,
) -> list[tuple[str, int, float, float]]:
    """`compare_former`: on the paged path, also capture and replay the former layout."""
    max_b = max(batches)
    eng = EngineConfig(
        max_num_seqs=max_b,
        kv_page_size=PAGE,
        graph_batch_sizes=tuple(batches),
        graph_context_sizes=(context,),
    )
    pages = 1 + max_b * -(-context // PAGE)
    t0 = time.perf_counter()
    stack = build_random_stack(raw, device, dtype, eng, num_slots=max_b + 1, num_pages=pages)
    graphs = captured(name, stack.model, stack.backend, eng, stack.cfg.max_model_len)
    print(f"# {name}: built and captured in {time.perf_counter() - t0:.1f}s")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    former = None
    if compare_former and resolve_backend(stack.device) == "triton":  # the paged path only
        own = ShortConvBackend(stack.pool, stack.device, stack.backend.extra_state)
        former = captured(f"{name}-former", stack.model, own, eng, context)
    rows = []
    for b in batches:
        plan = decode_plan(b, context)

        @torch.inference_mode()
        def eager(plan: StepPlan = plan) -> None:
            step = stack.backend.begin_step(plan)
            stack.model(step.input_ids, stack.backend)

        t_eager = _time(eager, iters, sync)
        t_graph = _time(lambda plan=plan: graphs.run(plan), iters, sync)
        assert graphs.stats().eager_fallbacks["no_bucket"] == 0
        rows.append((name, b, t_eager, t_graph))
        print(
            f"{name:10s} batch {b:4d}  eager {t_eager:8.3f} ms  graph {t_graph:8.3f} ms  "
            f"speedup {t_eager / t_graph:5.2f}x",
            flush=True,
        )
        if former is not None:
            t_former = _time(lambda plan=plan: former.run(plan), iters, sync)
            print(
                f"SUMMARY decode_bucket {name} batch={b} context={context} "
                f"single_bucket_ms={t_graph:.3f} former_ms={t_former:.3f} "
                f"ratio={t_graph / t_former:.2f}",
                flush=True,
            )
    return rows


def captured(
    name: str, model: Any, backend: ShortConvBackend, eng: EngineConfig, max_model_len: int
) -> GraphRunner:
    """A GraphRunner with every bucket captured, reported as one `SUMMARY capture` line."""
    graphs = GraphRunner(model, backend, eng, max_model_len)
    graphs.capture()
    st = graphs.stats()
    layout = "paged" if resolve_backend(backend.device) == "triton" else "dense"
    contexts = ",".join(str(c) for c in graphs.context_sizes)
    print(
        f"SUMMARY capture {name} attention={layout} graphs={st.num_graphs} "
        f"context_buckets={contexts} seconds={st.capture_seconds:.2f}",
        flush=True,
    )
    return graphs


def shallow(raw: dict[str, Any]) -> dict[str, Any]:
    """The same widths with 3 layers (conv, attention, conv for LFM2): compiles the same kernel
    specialisations as the full depth in a fraction of the build time."""
    out = {**raw, "num_hidden_layers": 3}
    if "full_attn_idxs" in raw:
        out["full_attn_idxs"] = [1]
    return out


def dry_run() -> None:
    for mod in GPU_IMPORTS:
        importlib.import_module(mod)
    print(f"DRYRUN decode ok: imported {list(GPU_IMPORTS)}")


def gpu_models(no_zaya: bool) -> list[tuple[str, dict[str, Any]]]:
    models = [("lfm2-350m", LFM2_350M)]
    if not no_zaya:  # our own model: an import error here is a bug, not a skip
        models.append(("zaya1", ZAYA1_BASE))
    return models


def summarize(rows: list[tuple[str, int, float, float]]) -> None:
    for name, b, te, tg in rows:
        print(
            f"SUMMARY decode {name} batch={b} eager_ms={te:.3f} graph_ms={tg:.3f} "
            f"speedup={te / tg:.2f}"
        )
    for name, b, te, tg in rows:
        if name == "lfm2-350m" and b == 1:
            verdict = "pass" if te / tg >= GRAPH_TARGET else "FAIL"
            print(
                f"SUMMARY target graph_vs_eager_b1_lfm2_350m value={te / tg:.2f} "
                f"target>={GRAPH_TARGET} {verdict}"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run on a tiny config")
    p.add_argument("--warmup", action="store_true", help="compile only: 3-layer models, 1 iter")
    p.add_argument("--dry-run", action="store_true", help="import everything, parse, exit")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--no-zaya", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        dry_run()
        return
    torch.manual_seed(0)
    if args.quick:
        torch.set_num_threads(1)  # a smoke run: no thread contention on a shared CI box
        device, dtype, batches, context, iters = "cpu", torch.float32, [1, 4], 32, 3
        models = [("lfm2-tiny", TINY_LFM2)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("decode_step.py needs CUDA; use --quick for the CPU smoke run")
        device, dtype, batches = "cuda", torch.bfloat16, [1, 8, 32, 128]
        context, iters, models = args.context, args.iters, gpu_models(args.no_zaya)
    if args.warmup:
        models, iters = [(f"{n}-shallow", shallow(raw)) for n, raw in models], 1
    print(f"# decode step, {device} {dtype}, context {context}, median of {iters}", flush=True)
    rows = []
    for i, (name, raw) in enumerate(models):
        # The first model alone (LFM2-350M on GPU) gets the layout A/B: the stage's budget.
        rows += bench_model(name, raw, batches, context, device, dtype, iters, i == 0)
        if device == "cuda":
            torch.cuda.empty_cache()  # the previous model is gone; give its memory back
    if args.warmup:
        print(f"# warmup: decode kernels compiled for {[n for n, _ in models]}")
    else:
        summarize(rows)


if __name__ == "__main__":
    main()
