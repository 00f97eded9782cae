"""Greedy parity of LFM3-VL with transformers' `generate` (fp32, CPU): transformers' own
processor makes each request (tests/lfm3_vl_inputs.py) and its tensors feed both."""

from __future__ import annotations

import pytest
from lfm3_vl_inputs import Lfm3VlCase, Pic, Request, lfm3_vl_case
from oracle import assert_matches_oracle
from triton_path import force_triton_path
from vision_engine import run_together

from shortconv import SamplingParams
from shortconv.engine.plan import StepPlan

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
WIDE = Pic(20, 44)  # 2 x 6 tokens
TALL = Pic(40, 16, seed=1)  # 5 x 2 tokens
SQUARE = Pic(32, 32, seed=2)  # 4 x 4 tokens, the most an image has


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Lfm3VlCase:
    return lfm3_vl_case(tmp_path_factory.mktemp("lfm3_vl"), MAX_NEW)


def run(
    case: Lfm3VlCase,
    requests: list[Request],
    budget: int = 512,
    plans: list | None = None,
    **engine: object,
) -> list[list[int]]:
    """Our greedy tokens for `requests`, all queued at once."""
    feed = [(r.ids, r.images) for r in requests]
    return run_together(case.path, feed, GREEDY, budget, plans, **engine)


def check(
    case: Lfm3VlCase,
    requests: list[Request],
    budget: int = 512,
    plans: list | None = None,
    **engine: object,
) -> None:
    outs = run(case, requests, budget, plans, **engine)
    for i, (req, out) in enumerate(zip(requests, outs, strict=True)):
        assert_matches_oracle(out, case.oracle(req), f"request {i}")


def test_one_image(case: Lfm3VlCase) -> None:
    req = case.request([("user", [WIDE, "What is this?"])])
    assert req.batch is not None and req.batch["image_grid_thw"].tolist() == [[1, 4, 12]]
    check(case, [req])


def test_the_image_changes_the_answer(case: Lfm3VlCase) -> None:
    """The oracle answers differently for other pixels of the same size, so the parity above
    is about the image and not only the text around it."""
    a = case.request([("user", [WIDE, "What is this?"])])
    b = case.request([("user", [Pic(20, 44, seed=7), "What is this?"])])
    assert a.ids == b.ids and case.oracle(a).tokens != case.oracle(b).tokens
    check(case, [a, b])


def test_graph_captured_decode(case: Lfm3VlCase) -> None:
    """Prompts with images run eagerly; every decode step replays a captured bucket."""
    requests = [
        case.request([("user", [WIDE, "What is this?"])]),
        case.request([("user", ["Text only."])]),
    ]
    check(case, requests, enable_graphs=True, graph_batch_sizes=(1, 2), graph_context_sizes=(64,))


def test_two_images_of_different_sizes_and_aspect_ratios(case: Lfm3VlCase) -> None:
    req = case.request([("user", [TALL, "and", SQUARE, "differ how?"])])
    assert req.batch is not None and req.batch["image_grid_thw"].tolist() == [[1, 10, 4], [1, 8, 8]]
    check(case, [req])


def test_image_in_a_later_turn(case: Lfm3VlCase) -> None:
    turns = [("user", ["Hi there."]), ("assistant", ["Hello!"]), ("user", [TALL, "Now this?"])]
    check(case, [case.request(turns)])


def test_batch_mixing_image_and_text_requests(case: Lfm3VlCase) -> None:
    requests = [
        case.request([("user", ["Only text here."])]),
        case.request([("user", [WIDE, "One image."])]),
        case.request([("user", ["Two:", SQUARE, TALL])]),
        case.request([("user", ["More text, a longer one this time."])]),
    ]
    check(case, requests)


def test_image_tokens_cross_chunk_boundaries(case: Lfm3VlCase) -> None:
    """A 7-token budget splits each image over several chunks (next to decodes of the other
    request); each image is still encoded once, in the step of its first chunk."""
    requests = [
        case.request([("user", [SQUARE, "Describe."])]),
        case.request([("user", ["Two:", WIDE, TALL])]),
    ]
    plans: list[StepPlan] = []
    check(case, requests, budget=7, plans=plans)
    encoded = [e.key for p in plans for e in p.encoder_inputs]
    assert len(encoded) == len(set(encoded)) == 3
    assert [s for p in plans for seq in p.seqs for s in seq.images if s.src > 0], "split images"
    assert sorted(k for p in plans for k in p.encoder_frees) == sorted(encoded)


def test_preempted_image_request_encodes_again(case: Lfm3VlCase) -> None:
    """Too few KV pages for both prompts: one is preempted mid-prompt and recomputed, its
    image encoded again under a new key, and both still match the oracle."""
    requests = [
        case.request([("user", [SQUARE, "Describe."])]),
        case.request([("user", [WIDE, SQUARE])]),
    ]
    # 55 and 60 tokens with the answers: 9 pages of 8 hold one, not both.
    assert [len(r.ids) for r in requests] == [47, 52]
    plans: list[StepPlan] = []
    check(case, requests, budget=16, plans=plans, num_kv_pages=10, kv_page_size=8)
    encoded = [e.key for p in plans for e in p.encoder_inputs]
    assert len(encoded) > 3, "a preempted request re-encodes its images"
    assert sorted(k for p in plans for k in p.encoder_frees) == sorted(encoded)


def test_triton_path_no_sdpa(case: Lfm3VlCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """The single-image case on the GPU path under the interpreter: Triton attention and no
    SDPA anywhere, the vision encoder's included. The oracle runs first (it uses SDPA)."""
    req = case.request([("user", [WIDE, "What is this?"])])
    ref = case.oracle(req)
    pytest.importorskip("triton")
    calls = force_triton_path(monkeypatch)
    (out,) = run(case, [req], budget=9)
    assert_matches_oracle(out, ref, "triton")
    assert calls["paged_attention_extend_triton"] and calls["paged_attention_decode_triton"]


def test_video_outputs_are_refused(case: Lfm3VlCase) -> None:
    """Only images: the processor's video tensors are refused, naming the field."""
    from shortconv.engine.images import GridImageInput
    from shortconv.sampling.sampling_params import InvalidRequest

    req = case.request([("user", [WIDE, "What is this?"])])
    assert req.batch is not None
    video = {
        "pixel_values_videos": req.batch["pixel_values"],
        "video_grid_thw": req.batch["image_grid_thw"],
    }
    with pytest.raises(InvalidRequest, match="video") as err:
        GridImageInput.split(req.batch | video)
    assert err.value.param == "images"
