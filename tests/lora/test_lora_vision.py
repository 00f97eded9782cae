"""LFM2-VL with a LoRA adapter on its language model: greedy parity with transformers + PEFT
(the adapter injected into the language model only), for an image request and a text request
under the adapter beside one on the bare base, in one batch. The encoder and projector are not
adaptable: an adapter that targets them is refused, naming the module."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_adapters import save_random_adapter
from oracle import OracleRun, assert_matches_oracle
from peft import LoraConfig, get_peft_model
from vision_inputs import Image, VisionCase, engine_images, hf_greedy, vision_case

from shortconv import SamplingParams
from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.llm import build_engine
from shortconv.lora.adapter import LoraError

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
UNTILED = Image(((6, 8),))
# The language model's projections only (PEFT matches the whole module name).
LANGUAGE = r".*language_model\.layers\.\d+\..*(in_proj|out_proj|q_proj|k_proj|v_proj|w1|w2|w3)"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[VisionCase, Path]:
    case = vision_case(tmp_path_factory.mktemp("lora_vl"), MAX_NEW)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=LANGUAGE, lora_dropout=0.0)
    case.hf = save_random_adapter(get_peft_model(case.hf, cfg), case.path / "lm_adapter", seed=1)
    return case, case.path / "lm_adapter"


def _engine(case: VisionCase, adapter: Path) -> LLMEngine:
    config = EngineConfig(enable_lora=True, max_loras=2, lora_modules={"lm": str(adapter)})
    return build_engine(case.path, dtype="float32", engine_config=config)


def _oracle(case: VisionCase, ids: list[int], batch: dict | None, lora: str | None) -> OracleRun:
    if lora is not None:
        return hf_greedy(case.hf, ids, batch, MAX_NEW)
    with case.hf.disable_adapter():
        return hf_greedy(case.hf, ids, batch, MAX_NEW)


def test_language_model_adapter_matches_peft(setup: tuple[VisionCase, Path]) -> None:
    case, adapter = setup
    pic = case.request([("user", [UNTILED, "What is this?"])])
    text = case.request([("user", ["Say something."])])
    jobs = [(pic, "lm"), (text, "lm"), (pic, None)]
    refs = [_oracle(case, ids, b, lora) for (ids, b, _), lora in jobs]
    assert refs[0].tokens != refs[2].tokens, "the adapter must change the tokens"
    engine = _engine(case, adapter)
    rids = [
        engine.add_request(ids, GREEDY, images=engine_images(imgs, b) if b else [], lora_name=lora)
        for (ids, b, imgs), lora in jobs
    ]
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    for rid, ref, (_, lora) in zip(rids, refs, jobs, strict=True):
        assert_matches_oracle(done[rid], ref, f"LFM2-VL request under {lora}")


def test_an_adapter_on_the_encoder_is_refused(setup: tuple[VisionCase, Path], tmp_path) -> None:
    case, adapter = setup
    engine = _engine(case, adapter)
    from shortconv.tiny.vision import build_hf_lfm2_vl

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["fc1"], lora_dropout=0.0)
    save_random_adapter(get_peft_model(build_hf_lfm2_vl(seed=3), cfg), tmp_path / "enc", seed=2)
    with pytest.raises(LoraError, match="vision_tower.*not a projection"):
        engine.load_lora("enc", str(tmp_path / "enc"))
    assert engine.lora_names() == ["lm"]
