"""int4's LM head and ffn_down choices, side by side in one process, on the token ids of a
llama-perplexity `--kl-divergence-base` file (bench/quant_kl_llamacpp.py makes one; its
Q4_K_M row is llama.cpp's side): mean KL(ours fp32 || ours int4) and top-1 agreement at
llama-perplexity's positions, and the bytes of linear weights a token reads, per variant.

    .venv/bin/python bench/q6_kl.py --model CKPT --f32 f32.gguf --base base.kld

Variants: int4 with the q8 head (before), the q6 head, and the q6 head plus q6 ffn_down in the
layers of Q4_K_M's rule (layers.int4_mix). The fp32 reference logits are computed once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from quant_kl_llamacpp import base_tokens, gguf_bos  # noqa: E402
from quant_quality import compare, prompt_logits, runner_for  # noqa: E402

from shortconv.layers import linear_binding  # noqa: E402
from shortconv.layers.linear import LinearBase  # noqa: E402
from shortconv.layers.quantize import Q6Linear, Q8Linear  # noqa: E402

VARIANTS: dict[str, tuple[linear_binding.Quantized, bool]] = {
    "int4, q8 head": (Q8Linear, False),
    "int4, q6 head": (Q6Linear, False),
    "int4, q6 head + q6 ffn_down": (Q6Linear, True),
}


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of every linear's weight as stored (what a decode token streams)."""
    total = 0
    for m in model.modules():
        if isinstance(m, LinearBase):
            stored = [w.nbytes for w in (m.q8, m.q4, m.q6) if w is not None]
            total += stored[0] if stored else m.weight.numel() * m.weight.element_size()
    return total


@torch.inference_mode()
def logits(runner, chunks: list[list[int]], bos: int | None) -> torch.Tensor:  # noqa: ANN001
    n_ctx = len(chunks[0])
    out = []
    for chunk in chunks:
        tokens = ([bos] + chunk[1:]) if bos is not None else chunk
        out.append(prompt_logits(runner, tokens)[n_ctx // 2 : n_ctx - 1])
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--f32", required=True, help="the F32 GGUF (its BOS rule)")
    ap.add_argument("--base", required=True, help="a llama-perplexity --kl-divergence-base file")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n_ctx, chunks = base_tokens(Path(args.base))
    bos = gguf_bos(Path(args.f32))
    ref = logits(runner_for(Path(args.model), "none", n_ctx), chunks, bos)
    print(f"{len(chunks)} chunks of {n_ctx}, {ref.shape[0]} positions")
    for name, (head, ffn_down) in VARIANTS.items():
        linear_binding.LM_HEAD_QUANTIZED["int4"] = head
        linear_binding.INT4_Q6_FFN_DOWN = ffn_down
        runner = runner_for(Path(args.model), "int4", n_ctx)
        q = compare(ref, logits(runner, chunks, bos))
        mb = linear_bytes(runner.model) / 1e6
        print(f"| {name} | {q.mean_kl:.4f} | {q.top1_agreement:.3f} | {mb:.1f} MB |", flush=True)
        del runner


if __name__ == "__main__":
    main()
