"""Speculative decoding at batch 1, ours against llama.cpp on the same weights and the same draft.

    .venv/bin/python bench/spec_llamacpp.py --shape lfm2-350m --threads 2

One random checkpoint (`bench/offline.py` SHAPES, seed 0) and its draft (the target cut to its
first `--draft-layers` layers, `shortconv.tiny.truncate`), both converted to F32 GGUF
(`bench/llamacpp_convert.py`). The same text prompt, a sentence repeated so prompt lookup has
matches, greedy, `--decode` new tokens, k = `--k` proposals a step. Rounds alternate between
the engines; medians are reported.

- ours: `LLM(...)` without speculation, with `ngram`, and with `draft_model` (the truncated
  draft, and the target as its own draft: full acceptance, so both engines are compared at
  the same acceptance). Tokens/s is decode only: the run with N + 1 tokens less the run with 1.
- llama.cpp (the llama-cpp-python 0.3.36 sdist, `bench/serve_llamacpp.py`): `llama-lookup`
  (prompt lookup, its n-gram method) and `llama-speculative` (a draft model): tokens/s is each
  tool's own "decoded N tokens in T seconds" line, acceptance its "accept" line. The
  no-speculation row is `llama-bench`'s generation speed at the prompt's depth (`-d`).
  `llama-speculative-simple` is not used: it refuses LFM2 with a draft ("the context does not
  support partial sequence removal"). A tool that fails is reported with its last log line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from offline import SHAPES  # noqa: E402
from serve_llamacpp import built_server  # noqa: E402
from spec_decode import _cpu_model, _spec_counts, decode_seconds  # noqa: E402

from shortconv.llm import LLM  # noqa: E402
from shortconv.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from shortconv.tiny.truncate import truncated_checkpoint  # noqa: E402

SENTENCE = "The quick brown fox jumps over the lazy dog while the cat watches. "
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")


def convert(ckpt: Path, out: Path) -> Path:
    cmd = [sys.executable, str(ROOT / "bench" / "llamacpp_convert.py"), str(ckpt), str(out)]
    subprocess.run([*cmd, "--outtype", "f32"], check=True, capture_output=True)
    return out


def llamacpp_run(tool: str, args: list[str]) -> tuple[float | None, float | None, str]:
    """(decode tok/s, acceptance in [0, 1] or None, last log line) of one llama.cpp run."""
    binary = built_server().parent / tool
    proc = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, errors="replace", timeout=900
    )
    log = proc.stderr + proc.stdout
    dec, acc = _DECODED.search(log), _ACCEPT.search(log)
    # An error line (" E ") says why better than the last line, which is often the text.
    errors = [ln for ln in proc.stderr.splitlines() if " E " in ln[:20]]
    why = " / ".join(dict.fromkeys(ln.split(" E ", 1)[1].strip() for ln in errors[-4:]))
    if proc.returncode != 0 or dec is None or errors:
        return None, None, f"{tool} exited {proc.returncode}: {why[:400] or 'no decode line'}"
    tok_s = int(dec.group(1)) / float(dec.group(2))
    return tok_s, (float(acc.group(1)) / 100 if acc else None), ""


def llamacpp_plain(gguf: Path, depth: int, n: int, threads: int) -> tuple[float | None, str]:
    """llama-bench's generation tokens/s after `depth` tokens of context, one repetition."""
    binary = built_server().parent / "llama-bench"
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(n), "-d", str(depth)]
    proc = subprocess.run(
        [*cmd, "-t", str(threads), "-r", "1", "-o", "jsonl"],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            return float(json.loads(line)["avg_ts"]), ""
    return None, (proc.stderr.strip().splitlines() or ["no output"])[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="lfm2-350m", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=4)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    text = SENTENCE * 6
    arch, overrides = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        target = make_tiny_checkpoint(arch, tmp / "target", overrides, seed=0)
        draft = truncated_checkpoint(target, args.draft_layers, tmp / "draft")
        t_gguf, d_gguf = convert(target, tmp / "t.gguf"), convert(draft, tmp / "d.gguf")
        drafts = {
            f"first {args.draft_layers} layers": (draft, d_gguf),
            "the target itself": (target, t_gguf),
        }
        k, n, th = str(args.k), str(args.decode), str(args.threads)
        common = ["-p", text, "-n", n, "--temp", "0", "-t", th, "-c", "1024", "-lv", "3"]
        ll_runs: dict[str, tuple[str, list[str]]] = {
            "ngram": ("llama-lookup", ["-m", str(t_gguf), "--spec-draft-n-max", k]),
        }
        for name, (_, gguf) in drafts.items():
            ll_runs[f"draft_model ({name})"] = (
                "llama-speculative",
                ["-m", str(t_gguf), "-md", str(gguf), "-td", th, "--spec-draft-n-max", k],
            )
        cfgs: dict[str, dict[str, object] | None] = {"none": None, "ngram": {"method": "ngram"}}
        for name, (ckpt, _) in drafts.items():
            cfgs[f"draft_model ({name})"] = {"method": "draft_model", "model": str(ckpt)}
        rows: dict[str, dict[str, list[float]]] = {m: {"ours": [], "llama": []} for m in cfgs}
        acc: dict[str, dict[str, float | None]] = {m: {} for m in cfgs}
        notes: dict[str, str] = {}
        for method, cfg in cfgs.items():
            spec = None if cfg is None else {**cfg, "num_speculative_tokens": args.k}
            llm = LLM(target, dtype="float32", max_num_seqs=4, speculative_config=spec)
            prompt = llm.tokenizer.encode(text)
            decode_seconds(llm, prompt, 8, cfg is not None)  # warm-up
            before = _spec_counts(llm) if cfg is not None else (0, 0, 0)
            for _ in range(args.rounds):
                secs = decode_seconds(llm, prompt, args.decode, cfg is not None)
                rows[method]["ours"].append(args.decode / secs)
                if cfg is None:
                    tok_s, why = llamacpp_plain(t_gguf, len(prompt), args.decode, args.threads)
                    a = None
                else:
                    tool, targs = ll_runs[method]
                    tok_s, a, why = llamacpp_run(tool, [*targs, *common])
                if tok_s is None:
                    notes[method] = why
                else:
                    rows[method]["llama"].append(tok_s)
                    acc[method]["llama"] = a
            if cfg is not None:
                _, proposed, accepted = (
                    x - y for x, y in zip(_spec_counts(llm), before, strict=True)
                )
                acc[method]["ours"] = accepted / proposed if proposed else 0.0
            llm.shutdown()
    print(f"# shape {args.shape}; threads {args.threads}; k = {args.k}; {_cpu_model()}")
    print(f"# {args.decode} greedy tokens after a {len(prompt)}-token prompt; F32 both sides")
    print(
        "| method | ours tok/s | ours acceptance | llama.cpp tok/s | llama.cpp acceptance "
        "| ours / llama.cpp |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for method in cfgs:
        ours = statistics.median(rows[method]["ours"])
        ll = rows[method]["llama"]
        ll_s = f"{statistics.median(ll):.1f}" if ll else "refused"
        ratio = f"{ours / statistics.median(ll):.2f}x" if ll else "-"
        print(
            f"| {method} | {ours:.1f} | {_pct(acc[method].get('ours'))} | {ll_s} | "
            f"{_pct(acc[method].get('llama'))} | {ratio} |"
        )
    for method, why in notes.items():
        print(f"\n{method}, llama.cpp: {why}")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


if __name__ == "__main__":
    main()
