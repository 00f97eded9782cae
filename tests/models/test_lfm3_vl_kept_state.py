"""LFM3-VL with kept state: a prefix-cache hit on the same image, a miss on another image
behind the same text (also under Triton), a resume inside an image, and a session's next
turn, each greedy-equal to transformers' `generate` on the whole prompt
(tests/lfm3_vl_inputs.py makes the requests)."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from lfm3_vl_inputs import Lfm3VlCase, Pic, Request, lfm3_vl_case
from oracle import OracleRun
from triton_path import force_triton_path
from vision_engine import KeptStateEngine, Served

from shortconv import SamplingParams
from shortconv.engine.images import key_stream

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
WIDE = Pic(20, 44)  # 12 tokens
TALL = Pic(40, 16, seed=1)  # 10 tokens


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Lfm3VlCase:
    return lfm3_vl_case(tmp_path_factory.mktemp("lfm3_vl"), MAX_NEW)


class Engine(KeptStateEngine):
    def __init__(self, case: Lfm3VlCase, budget: int = 512, **cfg: object) -> None:
        super().__init__(case.path, GREEDY, budget, **cfg)
        self.case = case

    def serve(self, req: Request, session: str | None = None) -> Served:
        """Run one request to the end, and check it against transformers."""
        return self.run(req.ids, req.images, self.case.oracle(req), session)


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


def test_a_hit_inside_an_image_encodes_it(case: Lfm3VlCase) -> None:
    """Only a checkpoint inside the image is left (the deeper ones discarded): the resumed
    request encodes the image and takes its rows from the resume point on."""
    eng = Engine(case)
    req = case.request([("user", [Pic(20, 44, seed=4), "What is this?"])])
    start = req.ids.index(case.hf.config.image_token_id)
    eng.serve(req)
    inner = (start // 8 + 1) * 8
    assert start < inner < start + 12
    tree = eng.eng.scheduler.cache_manager.tree
    keys = key_stream(req.ids, eng.eng.place_images(req.ids, req.images))
    for q in range(len(keys), inner, -1):
        entry = tree.find(keys[:q])
        if entry is not None:
            tree.discard(entry)
    resumed = eng.serve(req)
    assert (resumed.cached, resumed.encoded) == (inner, 1)
    mid = [s for p in eng.plans[-MAX_NEW:] for seq in p.seqs for s in seq.images]
    assert mid and mid[0].src == inner - start, "the rows from the resume point on"


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
