"""Speculation on the vision models: LFM2-VL and LFM3-VL, a request with an image among
text-only and non-speculating ones, n-gram and a text draft model, equal speculation off.

The oracle is the same engine with speculation off. The draft is the VL model's language side
saved as a text checkpoint (LFM2 or LFM3, the VL tokenizer): it proposes from the request's
token ids, image placeholders included, without seeing pixels, so it agrees with the target on
the text request and only partly on the image one (partial acceptance, where rollback bites).
Random 512-token models rarely repeat themselves, so n-gram proposals are mostly rejected:
that still rolls every state back to spec slot 1."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from lfm3_vl_inputs import Lfm3VlCase, Pic
from safetensors.torch import load_file, save_file
from vision_inputs import Image, engine_images, pixels, prompt

from shortconv.configs.config import EngineConfig
from shortconv.configs.hf.processors import load_processor
from shortconv.engine.llm_engine import LLMEngine
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.lfm3_vl import make_tiny_lfm3_vl
from shortconv.tiny.vision import build_tokenizer, make_tiny_lfm2_vl
from tests.engine.test_spec_decode import assert_nothing_held

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@dataclass
class VlModel:
    path: Path
    draft: Path
    requests: list[tuple[list[int], list]]  # (ids, engine images): image, text, image


def lfm2_vl_requests(path: Path) -> list[tuple[list[int], list]]:
    tok, out = build_tokenizer(1024), []
    for parts, seed in (([Image(((6, 8),)), "What is this?"], 1), (["Text only."], 0)):
        ids, images = prompt(tok, [("user", parts)])
        out.append((ids, engine_images(images, pixels(images, seed)) if images else []))
    return out


def lfm3_vl_requests(path: Path) -> list[tuple[list[int], list]]:
    case = Lfm3VlCase(path, None, load_processor(path), GREEDY.max_tokens)
    reqs = [case.request([("user", [Pic(20, 44), "What is this?"])])]
    reqs.append(case.request([("user", ["Text only."])]))
    return [(r.ids, r.images) for r in reqs]


def language_side(vl: Path, out: Path) -> Path:
    """The VL checkpoint's language model as a text checkpoint, with the VL tokenizer."""
    out.mkdir()
    prefix = "model.language_model."
    weights = load_file(vl / "model.safetensors")
    text = {"model." + k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    save_file(text, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((vl / "config.json").read_text())["text_config"]
    arch = {"lfm2": "Lfm2ForCausalLM", "lfm3": "Lfm3ForCausalLM"}[cfg["model_type"]]
    cfg |= {"architectures": [arch], "tie_word_embeddings": True}
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(vl / name, out / name)
    return out


def make_vl(arch: str, base: Path) -> VlModel:
    """A tiny `arch` ("lfm2_vl" or "lfm3_vl"), its language side as a draft, and the requests."""
    make = make_tiny_lfm2_vl if arch == "lfm2_vl" else make_tiny_lfm3_vl
    path = make(base / "vl", seed=3)
    draft = language_side(path, base / "draft")
    reqs = (lfm2_vl_requests if arch == "lfm2_vl" else lfm3_vl_requests)(path)
    return VlModel(path, draft, [reqs[0], reqs[1], reqs[0]])


@pytest.fixture(scope="module", params=["lfm2_vl", "lfm3_vl"])
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VlModel:
    return make_vl(request.param, tmp_path_factory.mktemp(request.param))


def spec_config(vl: VlModel, method: str | None) -> EngineConfig:
    """kv_page_size 8, speculation off (None), `ngram`, or the language-side draft (k = 3)."""
    draft = {"method": "draft_model", "model": str(vl.draft), "num_speculative_tokens": 3}
    spec = None if method is None else NGRAM if method == "ngram" else draft
    return EngineConfig(speculative_config=spec, kv_page_size=8)  # type: ignore[arg-type]


def run_requests(eng: LLMEngine, vl: VlModel) -> list[list[int]]:
    """The image request speculates, the text one too, the last (same image) does not."""
    params = [GREEDY, GREEDY, replace(GREEDY, speculative=False)]
    rids = [
        eng.add_request(ids, p, images=images)
        for (ids, images), p in zip(vl.requests, params, strict=True)
    ]
    done: dict[str, list[int]] = {}
    while eng.has_unfinished():
        done |= {o.request_id: o.token_ids for o in eng.step() if o.finished}
    return [done[r] for r in rids]


def run(vl: VlModel, method: str | None) -> tuple[list[list[int]], LLMEngine]:
    eng = build_engine(vl.path, dtype="float32", engine_config=spec_config(vl, method))
    out = run_requests(eng, vl)
    assert eng.executor.runner.images.entries == {}, "the encoder cache must end empty"
    return out, eng


def spec_counts(eng: LLMEngine) -> tuple[int, int]:
    s = eng.stats()
    return s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_an_image_request_speculates_losslessly(vl: VlModel, method: str) -> None:
    ref, _ = run(vl, None)
    ours, eng = run(vl, method)
    assert ours == ref
    assert ref[0] != ref[1]  # the image request is not the text one
    proposed, accepted = spec_counts(eng)
    assert accepted < proposed, (proposed, accepted)  # some proposal was rolled back
    assert_nothing_held(eng)
    if method == "draft_model":
        assert accepted > 0, (proposed, accepted)
        assert eng.scheduler.speculator.draft.num_held() == (0, 0)  # type: ignore[union-attr]
