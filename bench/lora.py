"""Multi-LoRA decode cost, side by side in one run: 8 rows decoding with 4 different rank-16
adapters (two rows each) against the same 8 rows on the bare base, in fp32 and int8.

    .venv/bin/python bench/lora.py                 # the lfm2-350m shape of bench/offline.py
    .venv/bin/python bench/lora.py --quick         # seconds (CI smoke), the tiny shape

One engine per dtype with `enable_lora` (max_loras 4, max_lora_rank 16), random weights and
random PEFT adapters on every projection PEFT targets. A round queues 8 requests (32-token
prompts), steps until all 8 decode, then times `--steps` decode steps; base and adapter rounds
alternate (A/B/A/B) so load that drifts on a shared machine cancels in the ratio, which is the
median over round pairs of adapter step / base step. Also printed: each adapter's resident
memory (the slot it takes in every layer, at max_lora_rank) and its files' tensors, and the
time to load one (read, check, write its slot).
Target: the adapter step costs at most 1.3x the base step, in fp32 and in int8.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offline import SHAPES  # noqa: E402

from shortconv.engine.llm_engine import LLMEngine  # noqa: E402
from shortconv.llm import LLM  # noqa: E402
from shortconv.lora.install import lora_layers  # noqa: E402
from shortconv.sampling.sampling_params import SamplingParams  # noqa: E402
from shortconv.tiny.checkpoint import build_hf_model, make_tiny_checkpoint  # noqa: E402

ROWS, ADAPTERS, RANK, PROMPT = 8, 4, 16, 32
TARGET = 1.3
TARGETS = ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "w1", "w2", "w3"]


def write_adapters(arch: str, overrides: dict, root: Path) -> list[Path]:
    """ADAPTERS random rank-RANK PEFT adapters on the shape's base (same base config)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(build_hf_model(arch, overrides, seed=0), cfg)
    paths = []
    for i in range(ADAPTERS):
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        paths.append(root / f"adapter{i}")
        model.save_pretrained(str(paths[-1]))
    return paths


def decode_step_s(engine: LLMEngine, names: list[str | None], steps: int) -> float:
    """Median seconds of one decode step with ROWS rows, row i under adapter names[i]."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i, name in enumerate(names):
        engine.add_request([5 + i] * PROMPT, params, lora_name=name)
    while engine.scheduler.waiting or any(not r.output_token_ids for r in _running(engine)):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def _running(engine: LLMEngine) -> list:
    return list(engine.scheduler.requests.values())


def slot_bytes(llm: LLM) -> int:
    """One adapter slot's bytes over every LoRA layer (A and B at max_lora_rank)."""
    model = llm.engine.executor.runner.model  # type: ignore[attr-defined]
    total = 0
    for layer in lora_layers(model).values():
        assert layer.lora is not None
        total += layer.lora.a[0].nbytes + layer.lora.b[0].nbytes
    return total


def run_dtype(ckpt: Path, adapters: list[Path], quant: str, steps: int, rounds: int) -> None:
    llm = LLM(
        ckpt,
        dtype="float32",
        quantization=quant,
        enable_lora=True,
        max_loras=ADAPTERS,
        max_lora_rank=RANK,
        max_num_seqs=ROWS,
    )
    engine = llm.engine
    t0 = time.perf_counter()
    engine.load_lora("a0", str(adapters[0]))
    load_s = time.perf_counter() - t0
    for i, path in enumerate(adapters[1:], 1):
        engine.load_lora(f"a{i}", str(path))
    mixed: list[str | None] = [f"a{i % ADAPTERS}" for i in range(ROWS)]
    decode_step_s(engine, [None] * ROWS, 2)  # warm-up
    decode_step_s(engine, mixed, 2)
    base, lora, ratios = [], [], []
    for _ in range(rounds):
        base.append(decode_step_s(engine, [None] * ROWS, steps))
        lora.append(decode_step_s(engine, mixed, steps))
        ratios.append(lora[-1] / base[-1])
    files = engine.loras.slots.get("a0").adapter.nbytes  # type: ignore[union-attr]
    ratio = statistics.median(ratios)
    print(
        f"SUMMARY lora {quant}: base step {1e3 * statistics.median(base):.2f} ms, "
        f"{ADAPTERS} adapters x rank {RANK} step {1e3 * statistics.median(lora):.2f} ms, "
        f"ratio {ratio:.2f} (target <= {TARGET}), slot {slot_bytes(llm) / 2**20:.2f} MiB, "
        f"files {files / 2**20:.2f} MiB, load {1e3 * load_s:.1f} ms",
        flush=True,
    )
    llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="lfm2-350m", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny shape, few steps (CI smoke)")
    args = p.parse_args()
    if args.quick:
        args.shape, args.steps, args.rounds = "lfm2-tiny", 2, 1
    arch, overrides = SHAPES[args.shape]
    if arch != "lfm2":
        p.error("the adapters target LFM2's projections: pick an lfm2 shape")
    print(f"# CPU: {torch.get_num_threads()} threads, shape {args.shape}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt = make_tiny_checkpoint(arch, root / "base", overrides=overrides, seed=0)
        adapters = write_adapters(arch, overrides, root)
        for quant in ("none", "int8"):
            run_dtype(ckpt, adapters, quant, args.steps, args.rounds)


if __name__ == "__main__":
    main()
