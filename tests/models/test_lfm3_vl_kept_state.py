"""LFM3-VL with kept state: a prefix-cache hit on the same image, a miss on another image
behind the same text (also under Triton), and a session's next turn, each greedy-equal to
transformers' `generate` on the whole prompt (tests/lfm3_vl_inputs.py makes the requests)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch.nn.functional as F
from lfm3_vl_inputs import Lfm3VlCase, Pic, Request, lfm3_vl_case
from oracle import OracleRun, assert_matches_oracle
from triton_path import force_triton_path

from shortconv import SamplingParams
from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.plan import StepPlan
from shortconv.llm import build_engine

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
WIDE = Pic(20, 44)  # 12 tokens
TALL = Pic(40, 16, seed=1)  # 10 tokens


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Lfm3VlCase:
    return lfm3_vl_case(tmp_path_factory.mktemp("lfm3_vl"), MAX_NEW)


@dataclass
class Served:
    tokens: list[int]
    cached: int  # prompt tokens resumed from kept state
    encoded: int  # images the encoder ran on for this request


class Engine:
    """One engine with 8-token pages and a checkpoint every page; requests run one by one."""

    def __init__(self, case: Lfm3VlCase, budget: int = 512, **cfg: object) -> None:
        config = EngineConfig(
            max_num_batched_tokens=budget, kv_page_size=8, prefix_checkpoint_interval=8, **cfg
        )
        self.case = case
        self.eng: LLMEngine = build_engine(case.path, dtype="float32", engine_config=config)
        self.plans: list[StepPlan] = []
        execute = self.eng.executor.execute
        self.eng.executor.execute = lambda plan: (self.plans.append(plan), execute(plan))[1]

    def serve(self, req: Request, session: str | None = None) -> Served:
        """Run one request to the end, and check it against transformers."""
        before = len(self.plans)
        self.eng.add_request(req.ids, GREEDY, session_id=session, images=req.images)
        outs = []
        while self.eng.has_unfinished():
            outs += [o for o in self.eng.step() if o.finished]
        (out,) = outs
        assert self.eng.executor.runner.images.entries == {}, "the encoder cache ends empty"
        assert_matches_oracle(out.token_ids, self.case.oracle(req), "kept state")
        encoded = sum(len(p.encoder_inputs) for p in self.plans[before:])
        return Served(out.token_ids, out.num_cached_tokens, encoded)


def hit_and_miss(case: Lfm3VlCase, eng: Engine) -> None:
    req = case.request([("user", [WIDE, "What is this?"])])
    start = req.ids.index(case.hf.config.image_token_id)
    end = start + 12
    first = eng.serve(req)
    assert (first.cached, first.encoded) == (0, 1)
    again = eng.serve(req)
    assert again.cached >= end and again.encoded == 0, "a hit after the image: not re-encoded"
    other = case.request([("user", [Pic(20, 44, seed=9), "What is this?"])])
    assert other.ids == req.ids and case.oracle(other).tokens != first.tokens
    missed = eng.serve(other)
    assert missed.cached <= start and missed.encoded == 1, "another image behind the same text"


def test_prefix_cache_hits_the_same_image_and_misses_another(case: Lfm3VlCase) -> None:
    hit_and_miss(case, Engine(case))


def test_prefix_cache_under_triton(case: Lfm3VlCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same under `SHORTCONV_KERNELS=triton TRITON_INTERPRET=1` with no SDPA in the engine
    (the oracle gets SDPA back around each of its runs)."""
    pytest.importorskip("triton")
    sdpa, oracle = F.scaled_dot_product_attention, case.oracle

    def oracle_with_sdpa(req: Request) -> OracleRun:
        with pytest.MonkeyPatch.context() as lifted:
            lifted.setattr(F, "scaled_dot_product_attention", sdpa)
            return oracle(req)

    monkeypatch.setattr(case, "oracle", oracle_with_sdpa)
    calls = force_triton_path(monkeypatch)
    hit_and_miss(case, Engine(case, budget=16))
    assert calls["paged_attention_extend_triton"] and calls["paged_attention_decode_triton"]


@pytest.mark.parametrize("new_image", [False, True], ids=["text", "new-image"])
def test_a_resumed_session_skips_its_first_image(case: Lfm3VlCase, new_image: bool) -> None:
    """A session's next turn resumes at the end-of-generation checkpoint after the first
    image (not encoded again) and encodes only its new image."""
    eng = Engine(case, enable_prefix_caching=False)
    req = case.request([("user", [WIDE, "What is this?"])])
    first = eng.serve(req, session="s")
    parts: list[str | Pic] = [TALL, "And this one?"] if new_image else ["Say more."]
    second = eng.serve(case.follow_up(req, first.tokens, parts), session="s")
    # Resumed at the end-of-generation checkpoint (the last sampled token was never fed).
    assert second.cached == len(req.ids) + MAX_NEW - 1
    assert second.encoded == int(new_image), "the first image is not encoded again"
