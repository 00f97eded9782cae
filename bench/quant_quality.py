"""Quality of `quantization`: teacher-forced next-token distributions against the unquantized
model on the same checkpoint, as mean KL divergence and top-1 agreement.

    .venv/bin/python bench/quant_quality.py --shape lfm2-350m --positions 2048
    .venv/bin/python bench/quant_quality.py --shape lfm2_moe-small --shape zaya1-100m

The prompts are fixed random token ids (seeded); every position's logits come from one prefill
of the whole sequence in chunks, through the engine's own runner (`ModelRunner`), so the
quantized path measured is the one served (q8 linears take the same AVX2 kernel at every batch
size). The LM head is quantized too (int8 under both formats, the engine's default);
`--float-head` keeps it in fp32.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shortconv.configs.config import EngineConfig  # noqa: E402
from shortconv.engine.plan import SamplingRow, SeqChunk, StepPlan  # noqa: E402
from shortconv.execution.parallel import SINGLE  # noqa: E402
from shortconv.execution.runner import ModelRunner  # noqa: E402
from shortconv.execution.worker_spec import plan_worker_spec  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402

PAGE = 16
_ROW = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)


@dataclass(frozen=True)
class Quality:
    positions: int
    mean_kl: float  # KL(reference || quantized), nats, averaged over positions
    top1_agreement: float  # share of positions whose argmax agrees


def runner_for(
    model_dir: Path, quantization: str, seq_len: int, quantize_lm_head: bool = True
) -> ModelRunner:
    """A one-sequence runner over `model_dir` in fp32 on CPU with `quantization`."""
    eng = EngineConfig(
        max_num_seqs=1,
        num_state_slots=2,
        kv_page_size=PAGE,
        num_kv_pages=-(-seq_len // PAGE) + 1,
        max_model_len=seq_len,
        enable_prefix_caching=False,
        enable_graphs=False,
        quantization=quantization,  # type: ignore[arg-type]
        quantize_lm_head=quantize_lm_head,
    )
    spec = plan_worker_spec(model_dir, eng, "float32")
    return ModelRunner(spec, SINGLE)


@torch.inference_mode()
def prompt_logits(runner: ModelRunner, tokens: list[int], chunk: int = 256) -> torch.Tensor:
    """Logits [len(tokens), vocab] of every position (teacher forcing), one sequence in slot 1,
    prefilled `chunk` tokens a step."""
    pages = tuple(range(1, 1 + -(-len(tokens) // PAGE)))
    out = []
    for step, start in enumerate(range(0, len(tokens), chunk)):
        piece = tuple(tokens[start : start + chunk])
        table = pages[: -(-(start + len(piece)) // PAGE)]
        seq = SeqChunk("q", piece, start, 1, table, _ROW)
        plan = StepPlan(step, (seq,))
        step_tensors = runner.backend.begin_step(plan)
        hidden = runner._forward(plan, step_tensors)
        out.append(runner.model.compute_logits(hidden).float())
    return torch.cat(out)


def compare(ref: torch.Tensor, got: torch.Tensor) -> Quality:
    """Mean KL(ref || got) of the softmaxes and top-1 agreement, over rows."""
    logp = torch.log_softmax(ref.double(), -1)
    logq = torch.log_softmax(got.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).double()
    return Quality(ref.shape[0], kl.mean().item(), agree.mean().item())


def fixed_prompts(vocab: int, positions: int, length: int = 512, seed: int = 0) -> list[list[int]]:
    """Random token ids (no special ids), `positions` in all, in sequences of `length`."""
    rng = random.Random(seed)
    n = -(-positions // length)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def measure(
    model_dir: Path,
    quantization: str,
    positions: int,
    length: int = 512,
    quantize_lm_head: bool = True,
) -> Quality:
    """Teacher-forced quality of `quantization` against none on `model_dir`."""
    ref_runner = runner_for(model_dir, "none", length)
    q_runner = runner_for(model_dir, quantization, length, quantize_lm_head)
    prompts = fixed_prompts(ref_runner.cfg.vocab_size, positions, length)
    refs = torch.cat([prompt_logits(ref_runner, p) for p in prompts])
    got = torch.cat([prompt_logits(q_runner, p) for p in prompts])
    return compare(refs, got)


def main() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from offline import SHAPES  # noqa: PLC0415 (bench's own shapes)

    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--float-head", action="store_true", help="keep the LM head in fp32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    what = args.quantization + (", fp32 LM head" if args.float_head else "")
    print("| shape | quantization | positions | mean KL (nats) | top-1 agreement | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in args.shape or ["lfm2-350m"]:
        arch, overrides = SHAPES[shape]
        with tempfile.TemporaryDirectory() as tmp:
            path = make_tiny_checkpoint(arch, tmp, overrides, seed=0, with_tokenizer=False)
            t0 = time.perf_counter()
            q = measure(
                path, args.quantization, args.positions, quantize_lm_head=not args.float_head
            )
            took = time.perf_counter() - t0
        print(
            f"| {shape} | {what} | {q.positions} | {q.mean_kl:.2e} | "
            f"{q.top1_agreement:.2%} | {took:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
