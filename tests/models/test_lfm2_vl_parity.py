"""Greedy parity of LFM2-VL with transformers' `generate` (fp32, CPU), the same inputs fed to
both: transformers' own processor on real images (`test_with_transformers_processor`), and
processor-shaped inputs with chosen tile grids (tests/vision_inputs.py) for the cases that need
an exact layout (chunk boundaries, preemption)."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_matches_oracle
from triton_path import force_triton_path
from vision_engine import run_together
from vision_inputs import Image, engine_images, vision_case
from vision_inputs import VisionCase as Case

from shortconv import SamplingParams
from shortconv.engine.images import ImageInput
from shortconv.engine.plan import StepPlan
from shortconv.sampling.sampling_params import InvalidRequest

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
UNTILED = Image(((6, 8),))  # 12 tokens
SQUARE = Image(((8, 8),))  # 16 tokens, the most an untiled image has
TILED = Image.tiled(1, 2, (4, 8))  # two 4-token tiles and an 8-token thumbnail
TALL = Image.tiled(2, 1, (8, 4))


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return vision_case(tmp_path_factory.mktemp("lfm2_vl"), MAX_NEW)


def run(
    case: Case, requests, budget: int = 512, plans: list | None = None, **engine: object
) -> list[list[int]]:
    """Our greedy tokens for (ids, [ImageInput]) requests, all queued at once."""
    return run_together(case.path, requests, GREEDY, budget, plans, **engine)


def run_images(case: Case, ids: list[int], images: list, **engine: object) -> list[list[int]]:
    return run(case, [(ids, images)], **engine)


def check(
    case: Case, requests, budget: int = 512, plans: list | None = None, **engine: object
) -> None:
    feed = [(ids, engine_images(imgs, b) if b else []) for ids, b, imgs in requests]
    outs = run(case, feed, budget, plans, **engine)
    for i, ((ids, b, _), out) in enumerate(zip(requests, outs, strict=True)):
        assert_matches_oracle(out, case.oracle(ids, b), f"request {i}")


def test_one_image(case: Case) -> None:
    check(case, [case.request([("user", [UNTILED, "What is this?"])])])


def test_graph_captured_decode(case: Case) -> None:
    """Prompts with images run eagerly; every decode step replays a captured bucket."""
    requests = [
        case.request([("user", [UNTILED, "What is this?"])]),
        case.request([("user", ["Text only."])]),
    ]
    check(case, requests, enable_graphs=True, graph_batch_sizes=(1, 2), graph_context_sizes=(64,))


def test_the_image_changes_the_answer(case: Case) -> None:
    """The oracle itself answers differently for other pixels, so the parity above is about
    the image and not only the text around it."""
    a = case.request([("user", [UNTILED, "What is this?"])], seed=0)
    b = case.request([("user", [UNTILED, "What is this?"])], seed=1)
    assert case.oracle(a[0], a[1]).tokens != case.oracle(b[0], b[1]).tokens
    check(case, [a, b])


@pytest.mark.parametrize("images", [(SQUARE, TILED), (TALL, UNTILED)], ids=["sq-tiled", "tall"])
def test_two_images_of_different_shapes(case: Case, images: tuple[Image, Image]) -> None:
    check(case, [case.request([("user", [images[0], "and", images[1], "differ how?"])])])


def test_image_in_a_later_turn(case: Case) -> None:
    turns = [("user", ["Hi there."]), ("assistant", ["Hello!"]), ("user", [TILED, "Now this?"])]
    check(case, [case.request(turns)])


def test_batch_mixing_image_and_text_requests(case: Case) -> None:
    requests = [
        case.request([("user", ["Only text here."])]),
        case.request([("user", [UNTILED, "One image."])], seed=1),
        case.request([("user", ["Two:", TILED, SQUARE])], seed=2),
        case.request([("user", ["More text, a longer one this time."])]),
    ]
    check(case, requests)


def test_image_tokens_cross_chunk_boundaries(case: Case) -> None:
    """A 7-token budget splits each image over several chunks (next to decodes of the other
    request); each image is still encoded once, in the step of its first chunk."""
    requests = [
        case.request([("user", [SQUARE, "Describe."])]),
        case.request([("user", ["Two:", TILED, UNTILED])], seed=4),
    ]
    plans: list[StepPlan] = []
    check(case, requests, budget=7, plans=plans)
    encoded = [e.key for p in plans for e in p.encoder_inputs]
    assert len(encoded) == len(set(encoded)) == 3
    mid_image = [s for p in plans for seq in p.seqs for s in seq.images if s.src > 0]
    assert mid_image, "some chunk must start inside an image"
    assert sorted(k for p in plans for k in p.encoder_frees) == sorted(encoded)


def test_triton_path_no_sdpa(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The single-image case on the GPU path under the interpreter: Triton attention and no
    SDPA anywhere, the vision encoder's included. The oracle runs first (it uses SDPA)."""
    request = case.request([("user", [UNTILED, "What is this?"])])
    ref = case.oracle(request[0], request[1])
    pytest.importorskip("triton")
    calls = force_triton_path(monkeypatch)
    (out,) = run_images(case, request[0], engine_images(request[2], request[1]), budget=9)
    assert_matches_oracle(out, ref, "triton")
    assert calls["paged_attention_extend_triton"] and calls["paged_attention_decode_triton"]


def test_preempted_image_request_encodes_again(case: Case) -> None:
    """Too few KV pages for both prompts: one is preempted mid-prompt and recomputed, its
    image encoded again under a new key, and both still match the oracle."""
    requests = [
        case.request([("user", [SQUARE, "Describe."])]),
        case.request([("user", [TILED, SQUARE])], seed=5),
    ]
    assert [len(r[0]) for r in requests] == [
        47,
        59,
    ]  # 55 and 67 with the answers: 9 pages of 8 hold one
    plans: list[StepPlan] = []
    check(case, requests, budget=16, plans=plans, num_kv_pages=10, kv_page_size=8)
    encoded = [e.key for p in plans for e in p.encoder_inputs]
    assert len(encoded) > 3, "a preempted request re-encodes its images"
    assert sorted(k for p in plans for k in p.encoder_frees) == sorted(encoded)


def test_n_above_one_with_images_is_refused(case: Case) -> None:
    """Forks copy the parent's state but carry no images: n > 1 is refused with them (naming
    the field) rather than decoding forks without their image. (Prefix caching and sessions
    serve images: tests/models/test_lfm2_vl_kept_state.py.)"""
    from shortconv import LLM

    ids, batch, images = case.request([("user", [UNTILED, "What is this?"])])
    llm = LLM(model=case.path, dtype="float32")  # prefix caching on
    with pytest.raises(InvalidRequest, match="n > 1") as err:
        llm.generate(
            prompt_token_ids=[ids],
            sampling_params=SamplingParams(max_tokens=2, n=2),
            images=[engine_images(images, batch)],
        )
    assert err.value.param == "n" and not llm.engine.has_unfinished()


@pytest.mark.parametrize("size", [(20, 24), (64, 40)], ids=["untiled", "tiled"])
def test_with_transformers_processor(case: Case, size: tuple[int, int]) -> None:
    """The checkpoint's own processor (AutoProcessor on the saved files: Lfm2VlProcessor and
    its torchvision-backed Lfm2VlImageProcessor) end to end."""
    from transformers import AutoProcessor, Lfm2VlProcessor

    processor = AutoProcessor.from_pretrained(case.path)
    assert isinstance(processor, Lfm2VlProcessor)
    image = torch.randint(0, 256, (3, *size), dtype=torch.uint8, generator=torch.Generator())
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hm?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(images=[[image]], text=[text], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    batch = {k: inputs[k] for k in ("pixel_values", "pixel_attention_mask", "spatial_shapes")}
    assert (len(batch["pixel_values"]) > 1) == (size == (64, 40))  # tiled: tiles + thumbnail
    images = ImageInput.split(batch, [len(batch["pixel_values"])])
    (out,) = run_images(case, ids, images)
    assert_matches_oracle(out, case.oracle(ids, batch), f"processor {size}")
