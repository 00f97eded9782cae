"""Disaggregated prefill of a prompt with an image (tiny LFM2-VL, no Ray): the prefill side
encodes the image and fills the prompt's state, the decode side imports the bundle and must
continue exactly as an engine that served the whole request itself (tokens and logprobs)."""

from __future__ import annotations

import asyncio
from typing import Any

from vision_inputs import TILE, Image, engine_images, pixels, prompt

from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.openai.handoff import PrefillCall, prefill_state
from shortconv.configs.config import EngineConfig
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.vision import build_tokenizer, make_tiny_lfm2_vl

G = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def engine(path: Any) -> AsyncEngine:
    cfg = EngineConfig(enable_prefix_caching=False, kv_page_size=4)
    eng = AsyncEngine(build_engine(path, dtype="float32", engine_config=cfg), admission_limit=4)
    eng.start()
    return eng


async def greedy(eng: AsyncEngine, ids: list[int], images: list, sid: str | None) -> tuple:
    tokens: list[int] = []
    lps: list[float] = []
    async for d in eng.generate(ids, G, f"r-{sid}", sid, images):
        tokens += d.token_ids
        lps += [float(x) for x in d.logprobs or () if x is not None]
        cached = d.num_cached_tokens
    return tokens, lps, cached


def test_an_image_prompt_handed_off_equals_one_engine(tmp_path: Any) -> None:
    path = make_tiny_lfm2_vl(tmp_path, seed=3)
    tok = build_tokenizer(1024)
    picture = Image.tiled(1, 2, (TILE, TILE))
    ids, images = prompt(tok, [("user", ["What is in", picture, "this picture?"])])
    inputs = engine_images(images, pixels(images, seed=1))

    async def main() -> None:
        pre, dec, plain = engine(path), engine(path), engine(path)
        got = await prefill_state(pre, PrefillCall(tuple(ids), tuple(inputs)), 120.0)
        assert got.bundle is not None
        assert await dec.state_op("import", "s", got.bundle)
        tokens, lps, cached = await greedy(dec, ids, inputs, "s")
        want, want_lps, _ = await greedy(plain, ids, inputs, None)
        assert cached == len(ids) - 1  # the image was encoded on the prefill side only
        assert tokens == want
        assert all(abs(a - b) < 1e-4 for a, b in zip(lps, want_lps, strict=True)), (lps, want_lps)

    asyncio.run(main())
