"""Offline throughput, side by side: our `LLM` against transformers' `generate`, same checkpoint.

    .venv/bin/python bench/offline.py --shape lfm2-350m --vs hf          # random 350M-class LFM2
    .venv/bin/python bench/offline.py --model DIR --vs hf --workloads a,b
    .venv/bin/python bench/offline.py --quick                            # seconds (CI smoke)
    python bench/offline.py --shape lfm2-350m --device cuda --workloads b  # bf16 on a GPU
    python bench/offline.py --dry-run --device cuda      # import what that run imports, exit

One process, one `torch.set_num_threads` for both engines, fp32 on CPU (bf16 with `--device
cuda`: both sides return host lists, so every timed call ends synchronised), greedy, EOS
ignored (both sides produce exactly the requested number of tokens). Each workload runs once
per side as warm-up, then A/B/A/B (ours, HF, ours, HF, ...) `--runs` times; tokens/s is useful
output tokens over the wall time of the whole call (medians printed). `ratio` is the median over run
pairs of HF time / our time (a pair runs back to back, so load that drifts between pairs on a
shared machine cancels); `ratio_of_medians` is printed next to it.

Workloads (`--quick` shrinks every size):
  a  one request: prompt 128, 128 new tokens.
  b  32 requests, prompt lengths spread evenly over 16..512 and output lengths over 16..256
     (independently shuffled). HF is batched the way a user batches it: all 32 left-padded into
     one `generate` call with `max_new_tokens` = the longest output; only each request's
     requested tokens count as useful (the padding and the tokens past a short request's end
     are HF's waste, which is what continuous batching removes).
  c  64 sessions x 4 turns: each turn appends a 32-token user message to the conversation
     (which starts with a 64-token system prompt) and generates 32 tokens. Ours submits every
     turn with `session_id`, so a turn prefills only its new suffix; HF re-runs each turn's
     whole conversation (all 64 left-padded in one `generate` call per turn).
Each side builds its next turn from its own replies; lengths, hence work, are identical.

Target (GPU): workload b in bf16, ours >= 5x transformers. The random checkpoint is
written by transformers; where the installed transformers lacks the architecture (ZAYA's
`zaya` on an older pin), no checkpoint can be written, so the run says so and exits 0 (ZAYA1's
kernels are then compared with our torch reference by tests/gpu/test_gpu_cca.py instead).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from shortconv.configs.hf.availability import transformers_lacks  # noqa: E402
from shortconv.llm import LLM  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from shortconv.tiny.checkpoint import ARCH_MODEL_TYPES, make_tiny_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import Workload, make_workloads, next_turn, warmup_of  # noqa: E402

# make_tiny overrides for the non-tiny shapes (weights are random; shapes are what matter).
LFM2_350M = {  # LFM2-350M: hidden 1024, 16 layers, attention at 2,5,8,10,12,14, vocab 65536
    "vocab_size": 65536,
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "intermediate_size": 6656,
    "block_auto_adjust_ff_dim": True,
    "block_multiple_of": 256,
    "block_ffn_dim_multiplier": 1.0,
    "rope_theta": 1_000_000.0,
    "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
}
ZAYA1_100M = {  # ZAYA1's layout (CCA + top-1 MoE of 16 experts) at ~110M total parameters
    "vocab_size": 32768,
    "hidden_size": 512,
    "head_dim": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_experts": 16,
    "moe_intermediate_size": 512,
    "router_hidden_size": 64,
    "max_position_embeddings": 4096,
}
LFM2_MOE_SMALL = {  # LFM2-MoE layout (dense layer 0, 8 experts top-2) at ~60M total
    "vocab_size": 16384,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "moe_intermediate_size": 512,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}
HF_TARGET = 5.0  # workload b, bf16 on a GPU: ours / transformers
# NOTE: what a run imports beyond the top of this file (the executor, the GPU kernels, the
# oracle); --dry-run imports exactly these (the kernels only with --device cuda).
RUN_IMPORTS = ("shortconv.execution.local_executor", "transformers", "shortconv.configs.config")
CUDA_IMPORTS = (
    "triton",
    "shortconv.kernels.conv1d_triton",
    "shortconv.kernels.cca_triton",
    "shortconv.kernels.attention_triton",
    "shortconv.kernels.moe_triton",
)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "lfm2-tiny": ("lfm2", {}),
    "lfm2-350m": ("lfm2", LFM2_350M),
    "lfm2_moe-tiny": ("lfm2_moe", {}),
    "lfm2_moe-small": ("lfm2_moe", LFM2_MOE_SMALL),
    "zaya1-tiny": ("zaya1", {}),
    "zaya1-100m": ("zaya1", ZAYA1_100M),
}


# ---- the two sides ------------------------------------------------------------------------
def ours_run(llm: LLM, w: Workload, tag: str) -> list[list[int]]:
    """Generate the workload with our engine; returns every request's tokens (turn-major)."""
    # NOTE: every run starts from an empty prefix cache: a repeated run of the same prompts
    # would otherwise resume from the previous run's checkpoints and measure nothing.
    llm.engine.flush_prefix_cache()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in w.outputs]
    if w.turns == 1:
        outs = llm.generate(prompt_token_ids=w.prompts, sampling_params=params)
        return [list(o.token_ids) for o in outs]
    eng, convs, got = llm.engine, [list(p) for p in w.prompts], []
    sids = [f"{tag}-s{i}" for i in range(len(convs))]
    for turn in range(w.turns):
        if turn:
            convs = next_turn(w, convs, got[-len(convs) :])
        rids = [
            eng.add_request(c, p, session_id=s) for c, p, s in zip(convs, params, sids, strict=True)
        ]
        done: dict[str, list[int]] = {}
        while len(done) < len(rids):
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.token_ids)
        got += [done[r] for r in rids]
    for s in sids:  # a clean pool for the next run
        eng.sessions.drop(s)
    return got


def hf_generate(
    model: Any, prompts: list[list[int]], max_new: int, pad: int, streamer: Any = None
) -> list[list[int]]:
    """One left-padded greedy `generate` call for all prompts (EOS never stops a row);
    `streamer` is passed to `generate` (bench/prefix_workload.py times the prefill with it)."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    dev = model.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        eos_token_id=None,
        pad_token_id=pad,
        bos_token_id=None,
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=cfg, streamer=streamer
        )
    return out[:, width:].tolist()


def hf_run(model: Any, w: Workload, pad: int) -> list[list[int]]:
    if w.turns == 1:
        rows = hf_generate(model, w.prompts, max(w.outputs), pad)
        return [r[:n] for r, n in zip(rows, w.outputs, strict=True)]
    convs, got = [list(p) for p in w.prompts], []
    for turn in range(w.turns):
        if turn:
            convs = next_turn(w, convs, got[-len(convs) :])
        got += hf_generate(model, convs, w.outputs[0], pad)
    return got


# ---- measurement --------------------------------------------------------------------------
def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    toks = fn()
    return time.perf_counter() - t0, toks


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens are identical (random weights: near-ties may
    legitimately flip a few; a low value means a bug, not noise)."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(1, len(a))


def bench_workload(llm: LLM, hf: Any | None, w: Workload, runs: int, pad: int) -> dict[str, Any]:
    ours_run(llm, warmup_of(w), "warm")
    if hf is not None:
        hf_run(hf, warmup_of(w), pad)
    ours_t, hf_t, agree = [], [], None
    for r in range(runs):
        t, mine = timed(lambda r=r: ours_run(llm, w, f"run{r}"))
        ours_t.append(t)
        if hf is not None:
            t, theirs = timed(lambda: hf_run(hf, w, pad))
            hf_t.append(t)
            agree = agreement(mine, theirs)
        assert sum(map(len, mine)) == w.useful_tokens
    res = {"workload": w.name, "useful_tokens": w.useful_tokens, "ours_s": ours_t, "hf_s": hf_t}
    res["ours_tok_s"] = w.useful_tokens / statistics.median(ours_t)
    if hf_t:
        res["hf_tok_s"] = w.useful_tokens / statistics.median(hf_t)
        # Each run pair is adjacent in time: its ratio cancels load that drifts between pairs.
        res["ratio"] = statistics.median(h / o for o, h in zip(ours_t, hf_t, strict=True))
        res["ratio_of_medians"] = res["ours_tok_s"] / res["hf_tok_s"]
        res["agreement"] = agree
    return res


def prepare_model(args: argparse.Namespace, tmp: str) -> tuple[Path, str]:
    if args.model:
        return Path(args.model), Path(args.model).name
    arch, overrides = SHAPES[args.shape]
    out = Path(args.ckpt_dir or tmp) / args.shape
    if not (out / "config.json").is_file():
        t0 = time.perf_counter()
        make_tiny_checkpoint(arch, out, overrides=overrides, seed=args.seed)
        print(f"# wrote {args.shape} checkpoint in {time.perf_counter() - t0:.1f}s", flush=True)
    return out, args.shape


def engine_kwargs(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from shortconv.configs.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    kw: dict[str, Any] = {"max_num_seqs": 64, "max_model_len": min(cfg.max_model_len, 4096)}
    if args.graphs != "default":
        kw["enable_graphs"] = args.graphs == "on"
    return kw


def dry_run(args: argparse.Namespace) -> None:
    import importlib

    mods = RUN_IMPORTS + (CUDA_IMPORTS if args.device == "cuda" else ())
    for mod in mods:
        importlib.import_module(mod)
    from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: F401

    arch = SHAPES[args.shape][0] if args.shape else "(--model)"
    lacks = transformers_lacks(ARCH_MODEL_TYPES[arch]) if args.shape else None
    print(
        f"DRYRUN offline ok: imported {list(mods)}; shape {args.shape} "
        f"arch {arch}: {lacks or 'transformers has it'}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face checkpoint directory")
    src.add_argument("--shape", choices=sorted(SHAPES), help="random checkpoint preset")
    p.add_argument("--vs", choices=["hf", "none"], default="hf")
    p.add_argument("--workloads", default="a,b,c")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--graphs", choices=["default", "on", "off"], default="default")
    p.add_argument("--ckpt-dir", help="keep/reuse generated checkpoints here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny shape and sizes: seconds")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: fp32 CPU, bf16 GPU")
    p.add_argument("--dry-run", action="store_true", help="import everything, parse, exit")
    args = p.parse_args(argv)
    if args.quick:
        args.shape = args.shape or "lfm2-tiny"
        args.runs = min(args.runs, 3)
        args.threads = 1
    elif not args.model and not args.shape:
        args.shape = "lfm2-350m"
    if args.dry_run:
        dry_run(args)
        return
    if args.shape and (lacks := transformers_lacks(ARCH_MODEL_TYPES[SHAPES[args.shape][0]])):
        print(
            f"# offline {args.shape}: skipped, {lacks}: no random checkpoint can be written "
            "(tests/gpu/test_gpu_cca.py compares ZAYA1 with our torch reference instead)"
        )
        print(f"SUMMARY offline shape={args.shape} status=skipped reason={lacks.replace(' ', '_')}")
        return
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, name = prepare_model(args, tmp)
        run(args, model_dir, name)


def run(args: argparse.Namespace, model_dir: Path, name: str) -> None:
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    llm = LLM(model_dir, dtype=dtype, device=args.device, **engine_kwargs(args, model_dir))
    cfg = llm.engine.model_cfg
    hf, pad = None, cfg.raw.get("pad_token_id") or 0
    if args.vs == "hf":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        hf = hf.to(args.device).eval()
    runner = llm.engine.executor.runner
    n_params = sum(t.numel() for t in runner.model.parameters())
    graphs = runner.graphs is not None
    print(
        f"# offline {name}: arch {cfg.arch}, {n_params / 1e6:.1f}M params, {dtype} "
        f"{args.device}, "
        f"threads {torch.get_num_threads()}, graphs {graphs}, "
        f"runs {args.runs}, load avg {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    workloads = make_workloads(cfg.vocab_size, args.quick, args.seed)
    for key in args.workloads.split(","):
        res = bench_workload(llm, hf, workloads[key], args.runs, pad)
        runs = " ".join(f"{t:.2f}" for t in res["ours_s"])
        line = f"SUMMARY offline shape={name} workload={key} ours_tok_s={res['ours_tok_s']:.1f}"
        if "ratio" in res:
            runs += " | hf " + " ".join(f"{t:.2f}" for t in res["hf_s"])
            line += (
                f" hf_tok_s={res['hf_tok_s']:.1f} ratio={res['ratio']:.2f} "
                f"ratio_of_medians={res['ratio_of_medians']:.2f} "
                f"greedy_agreement={res['agreement']:.2f}"
            )
        print(
            f"# {key}: {res['useful_tokens']} tokens, seconds per run: ours {runs}; "
            f"load avg {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        print(line, flush=True)
        if key == "b" and "ratio" in res and args.device == "cuda":
            verdict = "pass" if res["ratio"] >= HF_TARGET else "FAIL"
            print(
                f"SUMMARY target offline_b_vs_hf value={res['ratio']:.2f} "
                f"target>={HF_TARGET} {verdict} ({name}, {dtype})",
                flush=True,
            )
    llm.shutdown()


if __name__ == "__main__":
    main()
