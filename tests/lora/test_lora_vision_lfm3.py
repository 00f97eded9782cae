"""LFM3-VL with a LoRA adapter on its language model: greedy parity with transformers + PEFT
(the adapter injected into the language model only: every projection PEFT targets there,
LFM3's attention gate included), an image request and a text request under the adapter beside
an image request on the bare base, in one batch. The vision tower's projections carry the same
names but are not adaptable: an adapter that reaches them is refused, naming the module."""

from __future__ import annotations

from pathlib import Path

import pytest
from lfm3_vl_inputs import Lfm3VlCase, Pic, lfm3_vl_case
from lora_adapters import save_random_adapter
from oracle import OracleRun, assert_matches_oracle
from peft import LoraConfig, get_peft_model
from vision_inputs import hf_greedy

from shortconv import SamplingParams
from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.llm import build_engine
from shortconv.lora.adapter import LoraError

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
WIDE = Pic(20, 44)
# The language model's projections only (PEFT matches the whole module name).
LANGUAGE = (
    r".*language_model\.layers\.\d+\..*"
    r"(in_proj|out_proj|q_proj|k_proj|v_proj|o_proj|g_proj|w1|w2|w3)"
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Lfm3VlCase, Path]:
    case = lfm3_vl_case(tmp_path_factory.mktemp("lora_lfm3_vl"), MAX_NEW)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=LANGUAGE, lora_dropout=0.0)
    case.hf = save_random_adapter(get_peft_model(case.hf, cfg), case.path / "lm_adapter", seed=1)
    return case, case.path / "lm_adapter"


def _engine(case: Lfm3VlCase, adapter: Path) -> LLMEngine:
    config = EngineConfig(enable_lora=True, max_loras=2, lora_modules={"lm": str(adapter)})
    return build_engine(case.path, dtype="float32", engine_config=config)


def _oracle(case: Lfm3VlCase, ids: list[int], batch: dict | None, lora: str | None) -> OracleRun:
    if lora is not None:
        return hf_greedy(case.hf, ids, batch, MAX_NEW)
    with case.hf.disable_adapter():
        return hf_greedy(case.hf, ids, batch, MAX_NEW)


def test_language_model_adapter_matches_peft(setup: tuple[Lfm3VlCase, Path]) -> None:
    case, adapter = setup
    pic = case.request([("user", [WIDE, "What is this?"])])
    text = case.request([("user", ["Say something."])])
    jobs = [(pic, "lm"), (text, "lm"), (pic, None)]
    refs = [_oracle(case, r.ids, r.batch, lora) for r, lora in jobs]
    assert refs[0].tokens != refs[2].tokens, "the adapter must change the tokens"
    engine = _engine(case, adapter)
    rids = [engine.add_request(r.ids, GREEDY, images=r.images, lora_name=lora) for r, lora in jobs]
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    for rid, ref, (_, lora) in zip(rids, refs, jobs, strict=True):
        assert_matches_oracle(done[rid], ref, f"LFM3-VL request under {lora}")


def test_an_adapter_on_the_vision_tower_is_refused(
    setup: tuple[Lfm3VlCase, Path], tmp_path: Path
) -> None:
    from transformers import Lfm3VlForConditionalGeneration

    case, adapter = setup
    engine = _engine(case, adapter)
    base = Lfm3VlForConditionalGeneration.from_pretrained(case.path)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj"], lora_dropout=0.0)
    save_random_adapter(get_peft_model(base, cfg), tmp_path / "tower", seed=2)
    with pytest.raises(LoraError, match="vision_tower.*not a projection"):
        engine.load_lora("tower", str(tmp_path / "tower"))
    assert engine.lora_names() == ["lm"]
