"""What it costs to hand a session's state to another engine, next to re-prefilling it.

    .venv/bin/python bench/state_move.py              # lfm2-350m and zaya1-100m, 512 and 4096
    .venv/bin/python bench/state_move.py --quick      # seconds (CI smoke): tiny shapes

Per shape and context length, in one process: engine A serves a prompt of `ctx` tokens as
session "s" (one output token, so the kept state covers the prompt); its state is exported
(read off the ranks), serialized to a bundle, deserialized, and imported into engine B (same
checkpoint). Printed side by side: the bundle's bytes split into conv/CCA state (every
non-KV state kind: short-conv windows, ZAYA1's CCA conv and previous-token state) and KV
pages, the time of each phase (medians of `--runs`), and the prefill it saves: B serving the
same prompt with nothing cached. `import` is `import_session` end to end (it decodes and
checks the bundle again before writing), so handoff = export + serialize + import.

After the import B must continue the session as A does (a short second turn, greedy tokens
compared): a handoff that is fast because it moved the wrong thing fails the run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offline import SHAPES  # noqa: E402
from spec_decode import _cpu_model  # noqa: E402

from shortconv.cache import state_bundle  # noqa: E402
from shortconv.cache.kept_state import kept_state  # noqa: E402
from shortconv.cache.state_bundle import StateBundle  # noqa: E402
from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.llm import build_engine  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402

SHAPE_NAMES = {"full": ("lfm2-350m", "zaya1-100m"), "quick": ("lfm2-tiny", "zaya1-tiny")}
CONTEXTS = {"full": (512, 4096), "quick": (64, 256)}
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
NEXT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
T = TypeVar("T")


@dataclass(frozen=True)
class Row:
    shape: str
    ctx: int
    checkpoints: int  # pinned checkpoints the bundle carries
    state_bytes: int  # conv/CCA state, every non-KV kind
    kv_bytes: int
    bundle_bytes: int  # the whole bundle: tensors + header + checksum
    export_s: float
    serialize_s: float
    deserialize_s: float
    import_s: float
    prefill_s: float

    @property
    def handoff_s(self) -> float:
        return self.export_s + self.serialize_s + self.import_s


def serve(
    eng: LLMEngine, prompt: list[int], params: SamplingParams, session: str | None
) -> list[int]:
    rid = eng.add_request(prompt, params, session_id=session)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return list(out.token_ids)


def timed(fn: Callable[..., T], *args: Any) -> tuple[float, T]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def engine(model_dir: Path, ctx: int, dtype: str) -> LLMEngine:
    cfg = EngineConfig(max_model_len=ctx + 64, max_num_seqs=4)
    return build_engine(model_dir, dtype=dtype, engine_config=cfg)


def measure(a: LLMEngine, b: LLMEngine, prompt: list[int], runs: int) -> dict[str, list[float]]:
    """Phase times over `runs` handoffs of A's session "s" into B, and B's re-prefill."""
    times: dict[str, list[float]] = {k: [] for k in ("exp", "ser", "des", "imp", "pre")}
    st = a.session_state
    for _ in range(runs):
        held = kept_state(a.scheduler.cache_manager, "s")
        assert held is not None, "engine A keeps no state for the session"
        t, tensors = timed(a.executor.read_state, held.ids.slots, held.ids.pages)
        times["exp"].append(t)
        bundle = StateBundle(st.layout(), held.token_ids, held.checkpoints, tensors)
        t, data = timed(state_bundle.encode, bundle)
        times["ser"].append(t)
        times["des"].append(timed(state_bundle.decode, data)[0])
        b.flush_prefix_cache()
        t, ok = timed(b.import_session, "s", data)
        assert ok, f"engine B refused the bundle: {dict(b.session_state.counters.refused)}"
        times["imp"].append(t)
        b.flush_prefix_cache()
        times["pre"].append(timed(serve, b, prompt, ONE, None)[0])
    return times


def bench_one(shape: str, ctx: int, args: argparse.Namespace, root: Path) -> Row:
    arch, overrides = SHAPES[shape]
    model_dir = root / shape
    if not (model_dir / "config.json").is_file():
        longest = max(CONTEXTS["quick" if args.quick else "full"])
        over = {**overrides, "max_position_embeddings": longest + 64}
        make_tiny_checkpoint(arch, model_dir, overrides=over, seed=args.seed)
    a, b = engine(model_dir, ctx, args.dtype), engine(model_dir, ctx, args.dtype)
    vocab = a.model_cfg.vocab_size
    gen = torch.Generator().manual_seed(ctx)
    prompt = [int(t) for t in torch.randint(4, vocab, (ctx,), generator=gen)]
    serve(a, prompt, ONE, "s")
    times = measure(a, b, prompt, args.runs)
    data = a.export_session("s")
    assert data is not None
    check_continuation(a, b, data, prompt)
    moved = state_bundle.decode(data)
    tensors = moved.tensors
    kv = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith("kv"))
    state = sum(t.numel() * t.element_size() for n, t in tensors.items() if not n.startswith("kv"))
    med = {k: statistics.median(v) for k, v in times.items()}
    for eng in (a, b):
        eng.shutdown()
    phases = (med["exp"], med["ser"], med["des"], med["imp"], med["pre"])
    return Row(shape, ctx, len(moved.checkpoints), state, kv, len(data), *phases)


def check_continuation(a: LLMEngine, b: LLMEngine, data: bytes, prompt: list[int]) -> None:
    """B, from the moved state, continues the session with A's greedy tokens."""
    b.flush_prefix_cache()
    assert b.import_session("s", data)
    turn2 = prompt + [7, 8, 9]
    want, got = serve(a, turn2, NEXT, "s"), serve(b, turn2, NEXT, "s")
    assert got == want, f"moved session diverged: {got} != {want}"


HEADER = (
    "| shape | context | checkpoints | conv/CCA state KiB | KV KiB | bundle KiB | export ms | "
    "serialize ms | deserialize ms | import ms | handoff ms | re-prefill ms | prefill/handoff |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def row_line(r: Row) -> str:
    kib = 1024
    return (
        f"| {r.shape} | {r.ctx} | {r.checkpoints} | {r.state_bytes / kib:.1f} | "
        f"{r.kv_bytes / kib:.1f} | {r.bundle_bytes / kib:.1f} | {r.export_s * 1e3:.2f} | "
        f"{r.serialize_s * 1e3:.2f} | {r.deserialize_s * 1e3:.2f} | {r.import_s * 1e3:.2f} | "
        f"{r.handoff_s * 1e3:.2f} | {r.prefill_s * 1e3:.1f} | {r.prefill_s / r.handoff_s:.1f}x |"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes and contexts: seconds")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", help="keep/reuse generated checkpoints here")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.threads = 1, 1
    torch.set_num_threads(args.threads)
    size = "quick" if args.quick else "full"
    print(
        f"# state_move: {_cpu_model()}; threads {args.threads}; {args.dtype}; runs {args.runs}; "
        f"load avg {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    print(HEADER, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.ckpt_dir or tmp)
        # NOTE: the short contexts first, each row as it is measured: a slow machine still
        # reports something before the long prefills finish.
        for ctx in CONTEXTS[size]:
            for shape in SHAPE_NAMES[size]:
                rows.append(bench_one(shape, ctx, args, root))
                print(row_line(rows[-1]), flush=True)
    ratios = " ".join(f"{r.shape}@{r.ctx}={r.prefill_s / r.handoff_s:.1f}x" for r in rows)
    print(f"\nSUMMARY state_move prefill/handoff {ratios}")
    print(f"# load avg at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
