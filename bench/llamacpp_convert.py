"""Convert one of our random checkpoints to GGUF with llama.cpp's own converter, for the
llama.cpp side of the CPU benchmarks.

    python bench/llamacpp_convert.py CKPT_DIR OUT.gguf [--outtype f32]

llama.cpp's `convert_hf_to_gguf.py` recognises a BPE tokenizer by a hash of how it splits a
test string and refuses one it does not know ("BPE pre-tokenizer was not recognized"); our tiny
byte-level tokenizer is not LFM2's. Two local changes, as the quantization issue's author made
them, and nothing else: the pre-tokenizer is declared to be gpt-2's split rule, and the GGUF
gets one merge that never applies (the tokenizer has none, and llama.cpp requires the list).
Token ids, which is all `llama-bench` feeds, are untouched. The converter runs from the
llama-cpp-python sdist's vendored tree (`bench/serve_llamacpp.py` fetches and unpacks it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_llamacpp import source_dir  # noqa: E402

_RUN = """
import sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
import gguf
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
add_to_gguf = gguf.SpecialVocab.add_to_gguf
def with_a_merge(self, gw, quiet=False):
    self.merges = self.merges or ["\u0100 \u0101"]  # two byte tokens never merged
    return add_to_gguf(self, gw, quiet)
gguf.SpecialVocab.add_to_gguf = with_a_merge
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def convert(model_dir: Path, out: Path, outtype: str = "f32") -> Path:
    src = source_dir()
    cmd = [sys.executable, "-c", _RUN, str(src), str(model_dir), "--outtype", outtype]
    subprocess.run([*cmd, "--outfile", str(out)], check=True, env=dict(os.environ))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--outtype", default="f32")
    args = ap.parse_args()
    convert(args.model_dir, args.out, args.outtype)


if __name__ == "__main__":
    main()
