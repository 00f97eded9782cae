"""Compiled Triton CCA conv kernels (ZAYA1) against the torch reference at GPU model shapes.

Fixture-free like test_gpu_kernels.py, so a GPU check script can call these functions without
pytest. The interpreted twins of these checks are tests/kernels/test_cca_triton.py.

Greedy tokens, Triton vs our torch reference, are compared twice: on a random stack (no
transformers needed; tests/execution/test_gpu_cca_cpu.py runs the same check on CPU under the Triton
interpreter), and through `LLM` on a checkpoint written by transformers, skipped where the
installed transformers has no `zaya` model type (the GPU machine's 5.17 may not).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from graph_helpers import NUM_SEQS, PAGES_PER_SEQ, Seqs, engine_config

from shortconv.configs.hf.availability import transformers_lacks
from shortconv.tiny.random_stack import build_random_stack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PAD = -1
DTYPES = ((torch.float32, torch.int64), (torch.bfloat16, torch.int32))  # (values, indices)
# (Hq, Hk, head_dim): ZAYA1-like full width, its TP=2 shard, and a head_dim that is not a
# power of two (the kernel pads the head to a block and masks the tail).
HEADS = ((16, 2, 128), (8, 1, 128), (4, 2, 96))
TAPS = ((2, 2), (3, 3), (1, 3), (3, 1))
LENS = (129, 1, 17, 2, 64, 3)  # 129: one past a power of two


def _weights(chans: int, t0: int, t1: int, d: int, g: torch.Generator, dtype: torch.dtype):
    w = (
        torch.randn(chans, t0, generator=g) + 0.3,
        torch.randn(chans, generator=g),
        torch.randn(chans, d, t1, generator=g) / (d * t1) ** 0.5,
        torch.randn(chans, generator=g),
    )
    return tuple(t.cuda().to(dtype) for t in w)


def _batch(hq: int, hk: int, d: int, t0: int, t1: int, dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(hq * 1000 + d + 10 * t0 + t1)
    chans, k = (hq + hk) * d, (t0 - 1) + (t1 - 1)
    n = len(LENS) + 1  # plus one pad row
    all_lens = (*LENS[:2], 5, *LENS[2:])  # the pad row (5 tokens) sits third
    total = sum(all_lens) + 3  # + graph-padding tokens past query_start_loc[-1]
    x = (torch.randn(total, 2 * chans, generator=g) + 0.5)[:, :chans].t()  # token-major view
    states = torch.randn(2 * n + 1, chans, k, generator=g)
    qsl = torch.tensor([0, *torch.tensor(all_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.randperm(2 * n, generator=g)[:n] + 1
    slots[2] = PAD
    init = torch.rand(n, generator=g) > 0.3
    w = _weights(chans, t0, t1, d, g, dtype)
    cast = [t.cuda().to(dtype) for t in (x, states)]
    return (*cast, w, qsl.cuda(), slots.cuda(), init.cuda())


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def test_cca_fn_matches_ref_at_model_shapes():
    from shortconv.kernels.cca_ref import cca_conv_fn_ref
    from shortconv.kernels.cca_triton import cca_conv_fn_triton

    for hq, hk, d in HEADS:
        for t0, t1 in TAPS:
            for dtype in (torch.float32, torch.bfloat16):
                x, states, w, qsl, slots, init = _batch(hq, hk, d, t0, t1, dtype)
                ref_states, before = states.clone(), states.clone()
                want = cca_conv_fn_ref(x, *w, ref_states, qsl, slots, init, PAD)
                out = torch.full(x.shape, float("nan"), device="cuda", dtype=dtype)
                cca_conv_fn_triton(x, *w, states, qsl, slots, init, PAD, out=out)
                torch.testing.assert_close(out, want, **_tol(dtype))
                case = (hq, hk, d, t0, t1, dtype)
                assert torch.equal(states, ref_states), case  # pure copies: bit-identical
                owned = set(slots.tolist()) - {PAD}
                for slot in range(states.shape[0]):
                    if slot not in owned:
                        assert torch.equal(states[slot], before[slot]), (case, slot)


def test_cca_update_matches_ref_at_model_shapes():
    from shortconv.kernels.cca_ref import cca_conv_update_ref
    from shortconv.kernels.cca_triton import cca_conv_update_triton

    g = torch.Generator(device="cpu").manual_seed(3)
    for hq, hk, d in HEADS:
        chans = (hq + hk) * d
        for t0, t1 in TAPS:
            for batch in (1, 7, 129, 256):
                for dtype, idx_dtype in DTYPES:
                    w = _weights(chans, t0, t1, d, g, dtype)
                    x = torch.randn(batch, 3 * chans, generator=g)[:, :chans].cuda().to(dtype)
                    k = (t0 - 1) + (t1 - 1)
                    states = torch.randn(batch + 2, chans, k, generator=g).cuda().to(dtype)
                    slots = torch.randperm(batch + 1, generator=g)[:batch] + 1
                    slots[batch // 2] = PAD
                    slots = slots.to(idx_dtype).cuda()
                    ref_states = states.clone()
                    want = cca_conv_update_ref(x, ref_states, *w, slots, PAD)
                    got = cca_conv_update_triton(x, states, *w, slots, PAD)
                    torch.testing.assert_close(got, want, **_tol(dtype))
                    assert torch.equal(states, ref_states), (hq, d, t0, t1, batch, dtype)


def test_cca_update_replays_in_a_cuda_graph():
    """Captured once, replayed over refreshed indices and inputs: equal to eager every time."""
    from shortconv.kernels.cca_triton import cca_conv_update_triton

    hq, hk, d, batch = 16, 2, 128, 32
    chans = (hq + hk) * d
    g = torch.Generator(device="cpu").manual_seed(5)
    w = _weights(chans, 2, 2, d, g, torch.float32)
    x = torch.randn(batch, chans, device="cuda")
    states = torch.randn(batch * 2 + 1, chans, 2, device="cuda")
    idx = torch.zeros(batch, dtype=torch.int64, device="cuda")  # scratch slot at capture
    out = torch.empty(batch, chans, device="cuda")
    cca_conv_update_triton(x, states, *w, idx, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cca_conv_update_triton(x, states, *w, idx, out=out)
    for step in range(3):
        idx.copy_(torch.randperm(2 * batch, device="cuda")[:batch] + 1)
        idx[step] = PAD
        x.copy_(torch.randn(batch, chans, device="cuda"))
        ref_states = states.clone()
        want = cca_conv_update_triton(x, ref_states, *w, idx.clone())
        graph.replay()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert torch.equal(states, ref_states), step


ZAYA_TINY = {
    "architectures": ["ZayaForCausalLM"],
    "model_type": "zaya",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 32,
    "router_hidden_size": 16,
    "cca_time0": 3,
    "cca_time1": 2,
    "max_position_embeddings": 1024,
}
PROMPTS = ([5, 9, 13, 200, 7], [42, 3], list(range(30, 70)))


def _set_kernels(backend: str | None) -> None:
    if backend is None:
        os.environ.pop("SHORTCONV_KERNELS", None)
    else:
        os.environ["SHORTCONV_KERNELS"] = backend


def random_stack_tokens(device: str, backend: str, steps: int = 8) -> list[list[int]]:
    """Greedy tokens of a seeded random tiny ZAYA1 (prefill, then `steps - 1` decode steps)
    with SHORTCONV_KERNELS=`backend` (set before the build: layers bind their kernels then);
    no checkpoint and no transformers involved."""
    seqs, rows = Seqs([list(p) for p in PROMPTS]), list(range(len(PROMPTS)))
    saved = os.environ.get("SHORTCONV_KERNELS")
    _set_kernels(backend)
    try:
        stack = build_random_stack(
            ZAYA_TINY,
            device,
            torch.float32,
            engine_config(enable_graphs=False),
            num_slots=NUM_SEQS + 2,
            num_pages=1 + NUM_SEQS * PAGES_PER_SEQ,
            seed=3,
        )
        with torch.inference_mode():
            plan = seqs.prefill()
            for _ in range(steps):
                step = stack.backend.begin_step(plan)
                hidden = stack.model(step.input_ids, stack.backend)
                logits = stack.model.compute_logits(hidden[step.logits_indices])
                seqs.push(rows, tuple(logits.argmax(-1).tolist()))
                plan = seqs.decode(rows)
    finally:
        _set_kernels(saved)
    return [t[len(p) :] for t, p in zip(seqs.tokens, PROMPTS, strict=True)]


def check_zaya1_random_stack_triton_vs_torch(device: str) -> None:
    assert random_stack_tokens(device, "triton") == random_stack_tokens(device, "torch")


def test_zaya1_random_stack_greedy_triton_equals_torch_reference():
    check_zaya1_random_stack_triton_vs_torch("cuda")


def test_zaya1_greedy_tokens_same_on_cuda():
    """Tiny ZAYA1 checkpoint through `LLM` on CUDA: Triton CCA kernels (the default there) give
    the torch tokens. Needs transformers with `zaya` only to write the checkpoint."""
    reason = transformers_lacks("zaya")
    if reason is not None:
        pytest.skip(f"{reason}; compared on a random stack instead (test above)")
    from shortconv import LLM, SamplingParams
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 13, 200, 7], [42, 3], list(range(30, 70))]
    saved = os.environ.get("SHORTCONV_KERNELS")
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint("zaya1", tmp, {"cca_time0": 3, "cca_time1": 2}, seed=3)
        try:
            for backend in ("torch", "triton"):
                _set_kernels(backend)  # before the build: layers bind their kernels then
                llm = LLM(model=path, dtype="float32", device="cuda", seed=0, enable_graphs=False)
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                tokens[backend] = [o.token_ids for o in outs]
                llm.shutdown()
        finally:
            _set_kernels(saved)
    assert tokens["triton"] == tokens["torch"]
