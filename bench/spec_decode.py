"""Speculative decoding at batch 1: what a verify step costs, and what speculation buys.

    .venv/bin/python bench/spec_decode.py --shape lfm2-350m --threads 2

One random checkpoint, engines side by side in one process, rounds alternating between them:

1. **Verify cost.** One request, a 128-token prompt, then steps timed one by one: plain decode
   steps (speculation off) against verify steps of exactly k + 1 tokens (speculation on, the
   proposals forced to the request's own last k tokens, so every step verifies k of them
   whatever the model accepts; the acceptance switch-off is off). The ratio is the median
   verify step over the median decode step, at the same context, for each k in `--ks`, in
   fp32 and in int8.
2. **Speedup.** Decode tokens/s at batch 1 with and without speculation, with the measured
   acceptance (and the share of verify rows that kept proposal i, per position), for `ngram`
   and for `draft_model`. Cut as it is, a random target's first layers predict nothing of its
   output (0% acceptance), so this part runs on an *early-exit* target: the same checkpoint
   with the residual branches of its layers past `--draft-layers` scaled by `--draft-scale`
   (same shapes, so the same step costs), and its cut to those first layers as the draft
   (same embedding and head: `shortconv.tiny.early_exit`). The prompt is the one of
   `--loop-tries` random prompts whose greedy continuation repeats itself most (random models
   fall into loops; prompt lookup feeds on them). The shipped switch-off defaults apply; the
   bench reports the speedup that acceptance allows given the step costs of part 1 and the
   draft's own decode step (`allowed`), and the measured speedup's share of it.

A request's decode time is its run with N + 1 output tokens less its run with 1 (prefill and
the first token are not counted), as in bench/quant_speed.py.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from offline import SHAPES  # noqa: E402

from shortconv.engine.request import Request  # noqa: E402
from shortconv.llm import LLM  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from shortconv.tiny.early_exit import early_exit_pair  # noqa: E402

PROMPT = 128


def _greedy(n: int, speculative: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculative=speculative)


def _force_proposals(llm: LLM, k: int) -> None:
    """Every step of a speculating request verifies exactly k proposals: its own last k
    tokens (the cost of a verify step does not depend on what it accepts)."""
    spec = llm.engine.scheduler.speculator

    def propose(req: Request, limit: int) -> tuple[int, ...]:
        return tuple(req.all_token_ids[-min(k, limit) :])

    spec.propose = propose  # type: ignore[method-assign]


def step_times(llm: LLM, prompt: list[int], steps: int, speculative: bool) -> list[float]:
    """Seconds of each engine step after the prompt's prefill, one request alone."""
    eng = llm.engine
    eng.flush_prefix_cache()
    eng.add_request(prompt, _greedy(steps * 16, speculative))
    eng.step()  # the prefill (and the first token)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        out.append(time.perf_counter() - t0)
    while eng.has_unfinished():  # drain: abort the rest
        for rid in list(eng.scheduler.requests):
            eng.abort_request(rid)
    return out


def decode_seconds(llm: LLM, prompt: list[int], n: int, speculative: bool) -> float:
    def run(m: int) -> float:
        llm.engine.flush_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy(m, speculative))
        return time.perf_counter() - t0

    return run(n + 1) - run(1)


def _spec_counts(llm: LLM) -> tuple[int, ...]:
    """Verify rows, proposals, accepted proposals, then rows that kept proposal i, per i."""
    c = llm.engine.scheduler.speculator.counters
    return (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, *c.accepted_per_pos)


def repeats(tokens: list[int], n: int = 2) -> float:
    """Share of positions whose preceding n tokens occurred earlier: how much of a greedy
    continuation prompt lookup can find."""
    seen, hits = set(), 0
    for i in range(n, len(tokens)):
        key = tuple(tokens[i - n : i])
        hits += key in seen
        seen.add(key)
    return hits / max(1, len(tokens) - n)


def looping_prompt(path: Path, prompts: list[list[int]], n: int) -> tuple[list[int], float]:
    """The prompt whose greedy continuation of n tokens repeats itself most, and that share."""
    llm = LLM(path, dtype="float32", max_num_seqs=len(prompts))
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy(n, False))
    llm.shutdown()
    scores = [repeats(list(o.token_ids)) for o in outs]
    best = max(range(len(prompts)), key=scores.__getitem__)
    return prompts[best], scores[best]


def _interp(ratios: dict[int, float], k: float) -> float:
    """Verify/decode cost at a (mean) k, linear between measured points, 1.0 at k = 0."""
    pts = sorted({0: 1.0, **ratios}.items())
    for (k0, r0), (k1, r1) in zip(pts, pts[1:], strict=False):
        if k <= k1:
            return r0 + (r1 - r0) * (k - k0) / (k1 - k0)
    return pts[-1][1]


def _engine(path: Path, k: int, **kw: Any) -> LLM:
    # The acceptance switch-off stays off here: forced proposals accept what they accept,
    # and every step must still verify k of them.
    cfg = {"method": "ngram", "num_speculative_tokens": k, "min_acceptance_rate": 0.0}
    return LLM(path, dtype="float32", max_num_seqs=4, speculative_config=cfg, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="lfm2-350m", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--k", type=int, default=4, help="k of the n-gram speedup run")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per verify-cost run")
    ap.add_argument("--decode", type=int, default=96, help="tokens per speedup run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantizations", default="none,int8")
    ap.add_argument("--draft-layers", type=int, default=4, help="the draft: target's first N")
    ap.add_argument(
        "--draft-scale", type=float, default=0.1, help="residual scale past the draft's layers"
    )
    ap.add_argument("--loop-tries", type=int, default=4, help="random prompts to pick from")
    ap.add_argument("--quick", action="store_true", help="tiny shape, few steps (a smoke test)")
    ap.add_argument(
        "--adaptive-k", choices=("on", "off"), default="on", help="speedup runs' adaptive_k"
    )
    args = ap.parse_args()
    if args.quick:
        args.shape, args.steps, args.decode, args.rounds = "lfm2-tiny", 4, 8, 1
        args.draft_layers = 3
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    quants = args.quantizations.split(",")
    arch, overrides = SHAPES[args.shape]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(arch, Path(tmp) / "ckpt", overrides, seed=0)
        vocab = LLM(path, dtype="float32", max_num_seqs=1).engine.model_cfg.vocab_size
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT)]
        print(f"# shape {args.shape}; threads {args.threads}; {_cpu_model()}")
        ratios: dict[str, dict[int, float]] = {}
        for q in quants:
            kw = {} if q == "none" else {"quantization": q}
            llms = {k: _engine(path, k, **kw) for k in ks}
            for k, llm in llms.items():
                _force_proposals(llm, k)
            plain = llms[ks[0]]
            times: dict[int, list[float]] = {0: [], **{k: [] for k in ks}}
            runs: dict[int, Callable[[], list[float]]] = {
                0: lambda plain=plain: step_times(plain, prompt, args.steps, False),
                **{
                    k: (lambda llm=llm: step_times(llm, prompt, args.steps, True))
                    for k, llm in llms.items()
                },
            }
            for run in runs.values():
                run()  # warm-up
            for _ in range(args.rounds):
                for k, run in runs.items():
                    times[k] += run()
            base = statistics.median(times[0])
            ratios[q] = {k: statistics.median(times[k]) / base for k in ks}
            print(f"\n## verify step cost, {q} weights, batch 1, {PROMPT}-token context")
            print("| k | tokens verified | step ms | vs decode step |")
            print("| --- | --- | --- | --- |")
            print(f"| decode | 1 | {base * 1e3:.1f} | 1.00x |")
            for k in ks:
                med = statistics.median(times[k])
                print(f"| {k} | {k + 1} | {med * 1e3:.1f} | {med / base:.2f}x |")
            for llm in llms.values():
                llm.shutdown()
        target, draft = early_exit_pair(path, args.draft_layers, args.draft_scale, Path(tmp))
        tries = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(args.loop_tries)]
        looped, share = looping_prompt(target, tries, args.decode)
        methods = {
            "ngram": {"method": "ngram"},
            f"draft_model (target's first {args.draft_layers} layers)": {
                "method": "draft_model",
                "model": str(draft),
            },
        }
        print(
            f"\n## speculation at batch 1, k = {args.k} (adaptive k {args.adaptive_k}): decode "
            f"tok/s off and on; the early-exit target (layers past {args.draft_layers} scaled by "
            f"{args.draft_scale}); the prompt of {args.loop_tries} whose greedy continuation "
            f"repeats most ({share:.0%} of its positions follow a bigram seen before)"
        )
        print(
            "| weights | method | tok/s off | tok/s on | speedup | acceptance | "
            "proposed | accepted | tokens per verify | rows keeping proposal i | allowed | "
            "of allowed |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for q in quants:
            kw = {} if q == "none" else {"quantization": q}
            # The draft's cost per verify step: k proposals and one catch-up row, each about
            # one of its decode steps (measured on its own, speculation off).
            lone = LLM(draft, dtype="float32", max_num_seqs=4, **kw)
            decode_seconds(lone, looped, 8, False)
            t_draft = decode_seconds(lone, looped, args.decode, False) / args.decode
            lone.shutdown()
            for name, method in methods.items():
                cfg = {
                    **method,
                    "num_speculative_tokens": args.k,
                    "adaptive_k": args.adaptive_k == "on",
                }
                llm = LLM(target, dtype="float32", max_num_seqs=4, speculative_config=cfg, **kw)
                off: list[float] = []
                on: list[float] = []
                decode_seconds(llm, looped, args.decode, True)  # warm-up
                before = _spec_counts(llm)
                for _ in range(args.rounds):
                    off.append(decode_seconds(llm, looped, args.decode, speculative=False))
                    on.append(decode_seconds(llm, looped, args.decode, speculative=True))
                drafts, proposed, accepted, *per_pos = (
                    a - b for a, b in zip(_spec_counts(llm), before, strict=True)
                )
                kept_at = "/".join(f"{n / drafts:.0%}" for n in per_pos) if drafts else "-"
                llm.shutdown()
                # Steps of the timed runs in units of one target decode step: each round
                # decodes N + 1 tokens then 1, so its verify rows are counted twice over.
                t_dec = statistics.median(off) / args.decode
                n_tok = args.rounds * args.decode
                plain_steps = max(0, n_tok - drafts - accepted)
                k_mean = proposed / drafts if drafts else 0.0
                per_verify_cost = _interp(ratios[q], k_mean)
                if method["method"] == "draft_model":
                    per_verify_cost += (k_mean + 1) * t_draft / t_dec
                predicted = plain_steps + drafts * per_verify_cost
                allowed = n_tok / predicted if predicted else 1.0
                speedup = statistics.median(off) / statistics.median(on)
                acc = accepted / proposed if proposed else 0.0
                per_verify = (accepted + drafts) / drafts if drafts else 0.0
                print(
                    f"| {q} | {name} | {args.decode / statistics.median(off):.1f} | "
                    f"{args.decode / statistics.median(on):.1f} | {speedup:.2f}x | {acc:.0%} | "
                    f"{proposed} | {accepted} | "
                    f"{per_verify:.2f} | {kept_at} | {allowed:.2f}x | {speedup / allowed:.0%} |"
                )
    print("\nSUMMARY spec_decode", " ".join(f"{q}:k4={ratios[q].get(4, 0):.2f}x" for q in quants))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
