"""LFM2-VL with kept state: a prefix-cache hit on the same image, a miss on another image behind
the same text, a resume inside an image, and a session's next turn, each greedy-equal to
transformers' `generate` on the whole prompt (tests/vision_inputs.py builds the inputs)."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from oracle import OracleRun
from triton_path import force_triton_path
from vision_engine import KeptStateEngine, Served
from vision_inputs import Image, VisionCase, engine_images, follow_up, pixels, vision_case

from shortconv import SamplingParams
from shortconv.engine.images import key_stream

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
UNTILED = Image(((6, 8),))  # 12 tokens
TILED = Image.tiled(1, 2, (4, 8))  # two 4-token tiles and an 8-token thumbnail
QUESTION = [UNTILED, "What is this?"]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> VisionCase:
    return vision_case(tmp_path_factory.mktemp("lfm2_vl"), MAX_NEW)


class Engine(KeptStateEngine):
    def __init__(self, case: VisionCase, budget: int = 512, **cfg: object) -> None:
        super().__init__(case.path, GREEDY, budget, **cfg)
        self.case = case

    def serve(self, ids: list[int], batch: dict, images: list[Image], session=None) -> Served:
        """Run one request to the end, and check it against transformers."""
        imgs = engine_images(images, batch)
        return self.run(ids, imgs, self.case.oracle(ids, batch), session)

    def keys(self, ids: list[int], batch: dict, images: list[Image]) -> list[int]:
        assert self.eng.image_spec is not None
        placed = self.eng.place_images(ids, engine_images(images, batch))
        return key_stream(ids, placed)


def image_span(case: VisionCase, ids: list[int], size: int) -> tuple[int, int]:
    """[start, end) of the first image's `size` placeholders (one run: an untiled image)."""
    start = ids.index(case.tok.convert_tokens_to_ids("<image>"))
    return start, start + size


def hit_and_miss(case: VisionCase, eng: Engine) -> None:
    ids, batch, images = case.request([("user", QUESTION)], seed=0)
    start, end = image_span(case, ids, 12)
    first = eng.serve(ids, batch, images)
    assert (first.cached, first.encoded) == (0, 1)
    again = eng.serve(ids, batch, images)
    assert again.cached >= end and again.encoded == 0, "a hit after the image: not re-encoded"
    other_ids, other_batch, other_images = case.request([("user", QUESTION)], seed=1)
    assert other_ids == ids and case.oracle(ids, other_batch).tokens != first.tokens
    other = eng.serve(other_ids, other_batch, other_images)
    assert other.cached <= start and other.encoded == 1, "another image behind the same text"


def test_prefix_cache_hits_the_same_image_and_misses_another(case: VisionCase) -> None:
    hit_and_miss(case, Engine(case))


def test_prefix_cache_under_triton(case: VisionCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same under `SHORTCONV_KERNELS=triton TRITON_INTERPRET=1` with no SDPA in the engine
    (the oracle gets SDPA back around each of its runs)."""
    pytest.importorskip("triton")
    sdpa, oracle = F.scaled_dot_product_attention, case.oracle

    def oracle_with_sdpa(ids: list[int], batch: dict | None) -> OracleRun:
        with pytest.MonkeyPatch.context() as lifted:
            lifted.setattr(F, "scaled_dot_product_attention", sdpa)
            return oracle(ids, batch)

    monkeypatch.setattr(case, "oracle", oracle_with_sdpa)
    calls = force_triton_path(monkeypatch)
    hit_and_miss(case, Engine(case, budget=16))
    assert calls["paged_attention_extend_triton"] and calls["paged_attention_decode_triton"]


def test_a_hit_inside_an_image_encodes_it(case: VisionCase) -> None:
    """Only a checkpoint inside the image is left (the deeper ones discarded): the resumed
    request encodes the image and takes its rows from the resume point on."""
    eng = Engine(case)
    ids, batch, images = case.request([("user", QUESTION)], seed=2)
    start, end = image_span(case, ids, 12)
    eng.serve(ids, batch, images)
    inner = (start // 8 + 1) * 8
    assert start < inner < end
    tree, keys = eng.eng.scheduler.cache_manager.tree, eng.keys(ids, batch, images)
    for q in range(len(keys), inner, -1):
        entry = tree.find(keys[:q])
        if entry is not None:
            tree.discard(entry)
    resumed = eng.serve(ids, batch, images)
    assert (resumed.cached, resumed.encoded) == (inner, 1)
    mid = [s for p in eng.plans[-MAX_NEW:] for seq in p.seqs for s in seq.images]
    assert mid and mid[0].src == inner - start, "the rows from the resume point on"


@pytest.mark.parametrize(
    ("caching", "new_image"),
    [(False, False), (False, True), (True, True)],
    ids=["session", "session-new-image", "prefix-cache-new-image"],
)
def test_a_sessions_next_turn_resumes_after_its_image(
    case: VisionCase, caching: bool, new_image: bool
) -> None:
    eng = Engine(case, enable_prefix_caching=caching)
    ids, batch, images = case.request([("user", QUESTION)], seed=3)
    first = eng.serve(ids, batch, images, session="s")
    parts = [TILED, "And this one?"] if new_image else ["Say more."]
    ids2, more = follow_up(case.tok, ids, first.tokens, parts)
    images2 = images + more
    batch2 = pixels(images2, seed=3)  # the first image's pixels are drawn first: the same
    second = eng.serve(ids2, batch2, images2, session="s")
    # Resumed at the end-of-generation checkpoint (the last sampled token was never fed).
    assert second.cached == len(ids) + MAX_NEW - 1
    assert second.encoded == len(more), "the first image is not encoded again"
