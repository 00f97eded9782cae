"""Image requests offline, side by side: our `LLM` against transformers' `generate` on one
random LFM3-VL checkpoint, through transformers' own processor (its PIL backend).

    .venv/bin/python bench/vision.py                 # 1 and 4 images per request
    .venv/bin/python bench/vision.py --quick         # seconds (a smoke run)

The checkpoint is the tiny LFM3-VL's architecture widened (`SHAPES`), and its image processor
allows up to `--image-tokens` tokens an image; every image is drawn at that size. A workload is
`--requests` requests of a short question about 1 or 4 images and `--new` greedy tokens each
(EOS ignored). Ours queues them all at once (continuous batching; prefix caching off, so every
run encodes every image); transformers gets them in one left-padded `generate` call, as a user
batches it. Each side runs once as warm-up, then ours / HF alternately `--runs` times (medians).

`--throughput` gives our engine a batch job's step budget (the default caps a step's prompt
tokens at 32 on CPU while any request decodes, which bounds streams' inter-token gaps and
stretches a batch's prefill over many steps).

Printed per workload and side: image requests per second (requests over the whole call's wall
time) and TTFT: ours, the median over requests of the time to its first token within the
batched run; HF, the time of the same batch with `max_new_tokens=1` (every request's first
token comes at the end of its prefill). fp32, one `torch.set_num_threads` for both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

SHAPES = {  # the tiny LFM3-VL widened: enough work per token that the engines, not Python, show
    "text_config": {"hidden_size": 256, "intermediate_size": 768, "head_dim": 32},
    "vision_config": {"hidden_size": 128, "intermediate_size": 256},
    "projector_hidden_size": 256,
}


def checkpoint(out: Path, image_tokens: int) -> Path:
    from shortconv.tiny.lfm3_vl import TOKEN_PIXELS, lfm3_vl_config, make_tiny_lfm3_vl

    base = lfm3_vl_config().to_dict()
    text = {**base["text_config"], **SHAPES["text_config"]}
    vision = {**base["vision_config"], **SHAPES["vision_config"]}
    over = {**SHAPES, "text_config": text, "vision_config": vision}
    path = make_tiny_lfm3_vl(out, over, seed=0)
    cfg_path = path / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_pixels"] = image_tokens * TOKEN_PIXELS**2  # larger images: more tokens each
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return path


def images(n: int, side: int, seed: int) -> list[Any]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(n)
    ]


def texts(processor: Any, per_request: int, count: int) -> list[str]:
    out = []
    for i in range(count):
        content = [{"type": "image"}] * per_request + [{"type": "text", "text": f"Picture {i}?"}]
        out.append(
            processor.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
        )
    return out


def ours(llm: Any, feed: list[tuple[list[int], list[Any]]], new: int) -> tuple[float, float]:
    """(wall seconds, median TTFT seconds) of the batch, all queued at once."""
    from shortconv import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    eng = llm.engine
    start = time.perf_counter()
    rids = [eng.add_request(ids, params, images=imgs) for ids, imgs in feed]
    first: dict[str, float] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    return wall, statistics.median(first[r] for r in rids)


def hf(model: Any, batch: dict[str, torch.Tensor], new: int) -> float:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(**batch, generation_config=cfg)
    return time.perf_counter() - start


def workload(args: argparse.Namespace, path: Path, per_request: int) -> dict[str, float]:
    from transformers import Lfm3VlForConditionalGeneration

    from shortconv.configs.hf.processors import load_processor
    from shortconv.engine.images import GridImageInput
    from shortconv.llm import LLM
    from shortconv.tiny.lfm3_vl import TOKEN_PIXELS

    processor = load_processor(path)
    processor.tokenizer.padding_side = "left"
    side = int(args.image_tokens**0.5) * TOKEN_PIXELS
    prompts = texts(processor, per_request, args.requests)
    pics = [images(per_request, side, seed=i) for i in range(args.requests)]
    feed = []
    for text, req_pics in zip(prompts, pics, strict=True):
        one = processor(images=req_pics, text=[text], add_special_tokens=False, return_tensors="pt")
        feed.append((one["input_ids"][0].tolist(), GridImageInput.split(one)))
    flat = [p for req in pics for p in req]
    batch = processor(
        images=flat, text=prompts, add_special_tokens=False, padding=True, return_tensors="pt"
    )
    model = Lfm3VlForConditionalGeneration.from_pretrained(path).eval()
    llm = LLM(path, dtype="float32", enable_prefix_caching=False, **args.engine)
    ours(llm, feed, args.new), hf(model, batch, args.new)  # warm-up
    runs: dict[str, list[float]] = {"ours": [], "ours_ttft": [], "hf": [], "hf_ttft": []}
    for _ in range(args.runs):
        wall, ttft = ours(llm, feed, args.new)
        runs["ours"].append(wall)
        runs["ours_ttft"].append(ttft)
        runs["hf"].append(hf(model, batch, args.new))
        runs["hf_ttft"].append(hf(model, batch, 1))
    llm.shutdown()
    med = {k: statistics.median(v) for k, v in runs.items()}
    tokens = sum(len(ids) for ids, _ in feed) / len(feed)
    return {
        "images": per_request,
        "prompt_tokens": tokens,
        "ours_req_s": args.requests / med["ours"],
        "hf_req_s": args.requests / med["hf"],
        "ours_ttft_s": med["ours_ttft"],
        "hf_ttft_s": med["hf_ttft"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--image-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--throughput",
        action="store_true",
        help="the engine's step budget for a batch job, not for streams: 2048 tokens a step, "
        "as many of them prompt tokens while others decode (the default caps those at 32 on CPU)",
    )
    args = ap.parse_args()
    args.engine = {}
    if args.throughput:
        args.engine = {"max_num_batched_tokens": 2048, "max_prefill_tokens_while_decoding": 2048}
    if args.quick:
        args.requests, args.new, args.image_tokens, args.runs = 2, 2, 16, 1
    torch.set_num_threads(args.threads)
    print(f"# threads {args.threads}, {args.requests} requests, {args.new} new tokens each, ")
    print(f"# images of {args.image_tokens} tokens, median of {args.runs} alternating runs")
    print(f"# our engine: {args.engine or 'default step budget'}")
    print(
        "| images/request | prompt tokens | req/s ours | req/s HF | ratio | TTFT ours | TTFT HF |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp) / "lfm3_vl", args.image_tokens)
        for per_request in (1, 4):
            r = workload(args, path, per_request)
            print(
                f"| {r['images']} | {r['prompt_tokens']:.0f} | {r['ours_req_s']:.2f} | "
                f"{r['hf_req_s']:.2f} | {r['ours_req_s'] / r['hf_req_s']:.2f}x | "
                f"{r['ours_ttft_s'] * 1e3:.0f} ms | {r['hf_ttft_s'] * 1e3:.0f} ms |"
            )


if __name__ == "__main__":
    main()
