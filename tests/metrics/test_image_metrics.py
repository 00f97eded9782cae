"""Image metrics: images encoded and the encoder's seconds, counted by the engine and exported
(real prometheus_client registry over HTTP) for the tiny LFM3-VL, whose processor is
transformers' own (tests/lfm3_vl_inputs.py)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from lfm3_vl_inputs import Pic

from shortconv import SamplingParams
from shortconv.configs.hf.processors import load_processor
from shortconv.engine.images import GridImageInput
from shortconv.llm import LLM
from shortconv.metrics.recorder import serve_metrics
from shortconv.tiny.lfm3_vl import make_tiny_lfm3_vl

pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def prompt(processor: object, pics: list[Pic]) -> tuple[list[int], list[GridImageInput]]:
    content = [{"type": "image"} for _ in pics] + [{"type": "text", "text": "What is it?"}]
    text = processor.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    out = processor(  # type: ignore[operator]
        images=[p.pil() for p in pics] or None,
        text=[text],
        add_special_tokens=False,
        return_tensors="pt",
    )
    return out["input_ids"][0].tolist(), (GridImageInput.split(out) if pics else [])


def sample(text: str, name: str) -> float:
    (value,) = re.findall(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(value)


def test_images_encoded_and_encoder_seconds_are_exported(tmp_path: Path) -> None:
    path = make_tiny_lfm3_vl(tmp_path / "lfm3_vl", seed=3)
    processor = load_processor(path)
    requests = [
        prompt(processor, [Pic(20, 44), Pic(40, 16, seed=1)]),
        prompt(processor, []),
        prompt(processor, [Pic(32, 32, seed=2)]),
    ]
    llm = LLM(path, dtype="float32", enable_prefix_caching=False)
    server = serve_metrics(llm)
    try:
        llm.generate(
            prompt_token_ids=[ids for ids, _ in requests],
            sampling_params=GREEDY,
            images=[images for _, images in requests],
        )
        stats = llm.engine.stats()
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.close()
        llm.shutdown()
    assert stats.images_encoded_total == 3 and stats.encoder_seconds_total > 0
    assert sample(text, "shortconv_images_encoded_total") == 3
    assert sample(text, "shortconv_encoder_seconds_total") == pytest.approx(
        stats.encoder_seconds_total
    )
