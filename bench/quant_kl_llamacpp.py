"""Quantization quality against llama.cpp's at equal bits, on the same checkpoint and tokens.

    .venv/bin/python bench/quant_kl_llamacpp.py --model /path/to/lfm2-350m \\
        --f32 f32.gguf --quant int8=q8_0.gguf --quant int4=q4_k_m.gguf

llama.cpp's side is `llama-perplexity`: once on the F32 GGUF with `--kl-divergence-base FILE`
(it saves the text's tokens and the base log-probabilities), then on each quantized GGUF with
`--kl-divergence`, which prints the mean KL divergence from F32 and how often the top token is
the same. Ours reads the tokens back from that same file, so both sides score the very same
token ids: the same chunks of `--ctx` tokens (the first of each replaced by BOS when the GGUF
adds one), each scored at positions ctx/2 .. ctx-2 as llama-perplexity scores them, through
the engine's runner (bench/quant_quality.py), ours quantized against ours unquantized.
So each row is KL(F32 || Q8_0) beside KL(our fp32 || our int8) over the same positions.
The text defaults to this repository's docs (real English; the random checkpoint's tokenizer
is byte-level, so every byte is a token).
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import serve_llamacpp as llama  # noqa: E402
from quant_quality import compare, prompt_logits, runner_for  # noqa: E402


def perplexity_bin(explicit: str | None) -> Path:
    path = Path(explicit) if explicit else llama.source_dir() / "build" / "bin" / "llama-perplexity"
    if not path.is_file():
        raise SystemExit(
            f"no llama-perplexity at {path} (build llama.cpp: bench/serve_llamacpp.py)"
        )
    return path


def run_perplexity(binary: Path, args: list[str]) -> str:
    out = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, check=False, timeout=3600
    )
    if out.returncode != 0:
        raise SystemExit(f"{binary.name} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout + out.stderr


def parse_kld(log: str) -> tuple[float, float]:
    """(mean KL, same-top-token share) from llama-perplexity --kl-divergence's summary."""
    kl = re.search(r"Mean\s+KLD:\s+([-\d.eE+]+)", log)
    top = re.search(r"Same top p:\s+([\d.]+)", log)
    if not kl or not top:
        raise SystemExit(f"no KLD summary in llama-perplexity's output:\n{log[-2000:]}")
    return float(kl.group(1)), float(top.group(1)) / 100.0


def base_tokens(path: Path) -> tuple[int, list[list[int]]]:
    """(n_ctx, the chunks of tokens) from a --kl-divergence-base file: b"_logits_", u32 n_ctx,
    i32 n_vocab, i32 n_chunk, then n_chunk * n_ctx i32 tokens."""
    with path.open("rb") as f:
        if f.read(8) != b"_logits_":
            raise SystemExit(f"{path} is not a llama-perplexity logits file")
        n_ctx, _n_vocab, n_chunk = struct.unpack("<Iii", f.read(12))
        flat = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4")
    return n_ctx, [flat[i * n_ctx : (i + 1) * n_ctx].tolist() for i in range(n_chunk)]


def gguf_bos(gguf_path: Path) -> int | None:
    """The BOS id llama.cpp puts at each chunk's start, or None if the GGUF adds none."""
    sys.path.insert(0, str(llama.source_dir() / "gguf-py"))
    from gguf import GGUFReader  # noqa: PLC0415 (llama.cpp's own reader, from its source)

    fields = GGUFReader(gguf_path).fields

    def scalar(key: str) -> int | None:
        field = fields.get(key)
        return None if field is None else int(field.parts[field.data[0]][0])

    add = scalar("tokenizer.ggml.add_bos_token")
    return scalar("tokenizer.ggml.bos_token_id") if add else None


@torch.inference_mode()
def ours(model: Path, quant: str, chunks: list[list[int]], bos: int | None) -> tuple[float, float]:
    """Mean KL(ours fp32 || ours `quant`) and top-1 agreement at llama-perplexity's positions."""
    n_ctx = len(chunks[0])
    first = n_ctx // 2
    ref_runner, q_runner = runner_for(model, "none", n_ctx), runner_for(model, quant, n_ctx)
    refs, got = [], []
    for chunk in chunks:
        tokens = ([bos] + chunk[1:]) if bos is not None else chunk
        refs.append(prompt_logits(ref_runner, tokens)[first : n_ctx - 1])
        got.append(prompt_logits(q_runner, tokens)[first : n_ctx - 1])
    q = compare(torch.cat(refs), torch.cat(got))
    return q.mean_kl, q.top1_agreement


def default_text(out: Path, min_bytes: int) -> Path:
    parts, size = [], 0
    for doc in sorted((ROOT / "docs").glob("*.md")):
        parts.append(doc.read_text())
        size += len(parts[-1])
        if size >= min_bytes:
            break
    out.write_text("\n".join(parts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the HF checkpoint the GGUFs came from")
    ap.add_argument("--f32", required=True, help="its F32 GGUF")
    ap.add_argument("--quant", action="append", required=True, metavar="OURS=GGUF")
    ap.add_argument("--text", help="text file (default: the repo's docs)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=9, help="(ctx/2 - 1) positions scored each")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-perplexity", help="binary (default: the bench's llama.cpp build)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    binary = perplexity_bin(args.llama_perplexity)
    tmp = Path(tempfile.mkdtemp(prefix="qkl-"))
    text = (
        Path(args.text) if args.text else default_text(tmp / "text.txt", 2 * args.ctx * args.chunks)
    )
    base = tmp / "base.kld"
    common = ["-f", str(text), "-c", str(args.ctx), "--chunks", str(args.chunks)]
    common += ["-t", str(args.threads)]
    run_perplexity(binary, ["-m", args.f32, *common, "--kl-divergence-base", str(base)])
    n_ctx, chunks = base_tokens(base)
    bos = gguf_bos(Path(args.f32))
    positions = len(chunks) * (n_ctx - 1 - n_ctx // 2)
    cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if "model name" in ln)
    print(
        f"# {cpu}; {len(chunks)} chunks of {n_ctx} tokens, {positions} positions scored, BOS {bos}"
    )
    print("| ours | mean KL | top-1 | llama.cpp | mean KL | same top | KL ours / llama.cpp |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for spec in args.quant:
        name, gguf_path = spec.split("=", 1)
        log = run_perplexity(
            binary,
            ["-m", gguf_path, *common, "--kl-divergence-base", str(base), "--kl-divergence"],
        )
        their_kl, their_top = parse_kld(log)
        our_kl, our_top = ours(Path(args.model), name, chunks, bos)
        print(
            f"| {name} | {our_kl:.6f} | {our_top:.4f} | {Path(gguf_path).name} | {their_kl:.6f} "
            f"| {their_top:.4f} | {our_kl / their_kl:.2f} |",
            flush=True,
        )
    base.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
