"""Grammar-mask cost per decode step, next to the step it is part of (tiny model, CPU).

    .venv/bin/python bench/grammar_mask.py --batch 32 --steps 64

Two runs of `--batch` requests on the tiny random LFM2, in one process, interleaved
(free, constrained, free, constrained, ...): every request unconstrained, then every request
under a JSON schema long enough that no grammar ends inside the timed window (an array of
exactly 200 short strings). Prompts are prefilled before timing; each run then times
`--steps` decode steps of `LLMEngine.step()`. The grammar work of a step is timed by wrapping
its parts: `GrammarRuntime.row_masks` (fill a request's next-token bitmasks as the scheduler
plans its row) and `GrammarRuntime.prune` (once a step), `GrammarRuntime.accept` (advance each
matcher by its sampled token) and `apply_token_masks` (unpack the bitmasks and mask the logits
in the sampler). Reported: the
medians of the unconstrained step, the constrained step and the grammar part, and the grammar
part as a share of the constrained step (target <= 10%).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shortconv.llm import LLM  # noqa: E402
from shortconv.sampling import sampler as sampler_mod  # noqa: E402
from shortconv.sampling.grammar import GrammarSpec  # noqa: E402
from shortconv.sampling.grammar.runtime import GrammarRuntime  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402

LONG = {
    "type": "array",
    "items": {"type": "string", "minLength": 1, "maxLength": 6},
    "minItems": 200,
    "maxItems": 200,
}


class Timer:
    """Accumulates the time spent inside wrapped callables."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        return timed


def run(
    llm: LLM, batch: int, steps: int, grammar: GrammarSpec | None, timer: Timer
) -> list[tuple[float, float]]:
    """(step seconds, grammar seconds) for `steps` decode steps of a fresh batch."""
    eng = llm.engine
    params = SamplingParams(
        temperature=1.0, seed=1, max_tokens=steps + 8, ignore_eos=True, grammar=grammar
    )
    ids = [eng.add_request([5 + i % 200, 6, 7, 8], params) for i in range(batch)]
    while any(r.num_computed < len(r.prompt_token_ids) for r in eng.scheduler.requests.values()):
        eng.step()  # prefill (and the first token), not timed
    out = []
    for _ in range(steps):
        timer.total = 0.0
        t0 = time.perf_counter()
        eng.step()
        out.append((time.perf_counter() - t0, timer.total))
    for rid in ids:
        eng.abort_request(rid)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    ckpt = make_tiny_checkpoint("lfm2", tempfile.mkdtemp(prefix="gm-"), seed=0)
    llm = LLM(model=ckpt, dtype="float32", seed=0, max_num_seqs=args.batch)
    timer = Timer()
    GrammarRuntime.row_masks = timer.wrap(GrammarRuntime.row_masks)  # type: ignore[method-assign]
    GrammarRuntime.prune = timer.wrap(GrammarRuntime.prune)  # type: ignore[method-assign]
    GrammarRuntime.accept = timer.wrap(GrammarRuntime.accept)  # type: ignore[method-assign]
    sampler_mod.apply_token_masks = timer.wrap(sampler_mod.apply_token_masks)
    spec = GrammarSpec.json_schema(LONG)
    run(llm, args.batch, 8, None, timer), run(llm, args.batch, 8, spec, timer)  # warm-up
    free: list[float] = []
    con: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        free += [s for s, _ in run(llm, args.batch, args.steps, None, timer)]
        con += run(llm, args.batch, args.steps, spec, timer)
    # The unconstrained step's grammar share is the cost every request pays for the feature.
    step_free = statistics.median(free)
    step_con = statistics.median(s for s, _ in con)
    mask = statistics.median(g for _, g in con)
    print(f"batch {args.batch}, {args.rounds} x {args.steps} decode steps per variant")
    print(f"  unconstrained step      {step_free * 1e3:8.3f} ms")
    print(f"  constrained step        {step_con * 1e3:8.3f} ms  ({step_con / step_free:.2f}x)")
    print(
        f"  grammar part of a step  {mask * 1e3:8.3f} ms  = {mask / step_con:.1%} of the "
        f"constrained step, {mask / step_free:.1%} of the unconstrained one"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
