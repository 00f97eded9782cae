"""Triton CCA conv kernels (ZAYA1) against the torch reference, under Triton's interpreter.

TRITON_INTERPRET is set per test (cca_triton jits lazily once per mode, like conv1d_triton).
Inputs are random and offset from zero so that a kernel that skips a term cannot pass, and
outputs are NaN-poisoned so that a token the kernel forgets to write shows up.
The same comparisons at GPU shapes live in tests/gpu/test_gpu_cca.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shortconv.kernels import cca_conv_fn, cca_conv_update  # noqa: E402
from shortconv.kernels.cca_ref import cca_conv_fn_ref, cca_conv_update_ref  # noqa: E402

N_SLOTS, PAD = 10, -1
LENS = (2, 5, 3, 1, 33)  # the third row (3 tokens) is a pad row
SLOTS = (6, 3, PAD, 8, 1)  # permuted, non-contiguous
HAS_INIT = (True, False, True, True, False)
TAIL = 2  # graph-padding tokens past query_start_loc[-1]
UNOWNED = (0, 2, 4, 5, 7, 9)  # scratch slot (pad clamp target) and the live slots' neighbours


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("SHORTCONV_KERNELS", raising=False)


def _triton():  # noqa: ANN202 - the module, imported once TRITON_INTERPRET is set
    from shortconv.kernels import cca_triton

    return cca_triton


def make_case(t0: int, t1: int, hq: int, hk: int, d: int, dtype: torch.dtype = torch.float32):
    """(x [C, T+TAIL] token-major strided view, (w0, b0, w1, b1), states, qsl, has_init)."""
    g = torch.Generator().manual_seed(100 * t0 + 10 * t1 + d + hq)
    chans, k = (hq + hk) * d, (t0 - 1) + (t1 - 1)
    total = sum(LENS) + TAIL
    x = (torch.randn(total, 2 * chans, generator=g) + 0.5)[:, chans:].t()
    w = (
        torch.randn(chans, t0, generator=g) + 0.3,
        torch.randn(chans, generator=g) + 0.3,
        (torch.randn(chans, d, t1, generator=g) + 0.1) / d,
        torch.randn(chans, generator=g) + 0.3,
    )
    states = torch.randn(N_SLOTS, chans, k, generator=g) + 0.5
    qsl = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    x, states = x.to(dtype), states.to(dtype)
    return x, tuple(t.to(dtype) for t in w), states, qsl, torch.tensor(HAS_INIT)


def _nan(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


CONFIGS = [
    pytest.param(hq, hk, d, idx, id=f"h{hq}/{hk}-d{d}-{str(idx)[6:]}")
    for hq, hk, idx in ((4, 2, torch.int32), (3, 1, torch.int64))
    for d in (8, 12)
]


@pytest.mark.parametrize("hq,hk,d,idx_dtype", CONFIGS)
@pytest.mark.parametrize("t0,t1", [(2, 2), (3, 1), (1, 3), (3, 3)])
def test_fn_then_update_match_ref(
    t0: int, t1: int, hq: int, hk: int, d: int, idx_dtype: torch.dtype
) -> None:
    tri = _triton()
    x, w, states, qsl, has_init = make_case(t0, t1, hq, hk, d)
    slots = torch.tensor(SLOTS, dtype=idx_dtype)
    ref_states, before = states.clone(), states.clone()
    want = cca_conv_fn_ref(x, *w, ref_states, qsl, slots, has_init, PAD)
    out = _nan(tuple(x.shape))
    got = tri.cca_conv_fn_triton(x, *w, states, qsl, slots, has_init, PAD, out=out)
    assert got is out and not out.isnan().any()  # every column written, live or not
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    pad_cols = slice(sum(LENS[:2]), sum(LENS[:3]))
    assert not out[:, pad_cols].any() and not out[:, -TAIL:].any()
    assert torch.equal(states, ref_states)  # the write-back is a pure copy: bit-identical
    for slot in UNOWNED:
        assert torch.equal(states[slot], before[slot]), slot

    # Decode from those states: a prefilled slot, a pad row, a resumed one, an untouched one.
    idx = torch.tensor([1, PAD, 6, 9], dtype=idx_dtype)
    mid = states.clone()
    g = torch.Generator().manual_seed(7)
    for step in range(2):
        xd = (torch.randn(4, 2 * x.shape[0], generator=g) + 0.5)[:, ::2]  # column stride 2
        want = cca_conv_update_ref(xd, ref_states, *w, idx, PAD)
        out = _nan((4, x.shape[0]))
        got = tri.cca_conv_update_triton(xd, states, *w, idx, PAD, out=out)
        assert got is out and not out.isnan().any() and not out[1].any()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(states, ref_states), step
    for slot in (0, 2, 3, 4, 5, 7, 8):  # neither a decode row's slot nor written by it
        assert torch.equal(states[slot], mid[slot]), slot


def test_prefill_then_decode_equals_full_prefill() -> None:
    """Prefill all but the last 3 tokens of the 33-token row, decode those: same as one go."""
    tri = _triton()
    x, w, states, qsl, has_init = make_case(3, 3, 3, 1, 12)
    slots = torch.tensor(SLOTS)
    full_states = states.clone()
    full = tri.cca_conv_fn_triton(x, *w, full_states, qsl, slots, has_init, PAD)
    end, steps = int(qsl[-1]), 3
    pre_qsl = qsl.clone()
    pre_qsl[-1] = end - steps
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    keep[end - steps : end] = False
    tri.cca_conv_fn_triton(x[:, keep], *w, states, pre_qsl, slots, has_init, PAD)
    for s in range(steps):
        tok = end - steps + s
        got = tri.cca_conv_update_triton(x[:, tok][None], states, *w, slots[-1:], PAD)
        torch.testing.assert_close(got[0], full[:, tok], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, full_states, rtol=0, atol=0)


def test_no_bias_empty_and_all_pad() -> None:
    tri = _triton()
    x, (w0, _, w1, _), states, qsl, has_init = make_case(2, 2, 4, 2, 8)
    slots = torch.tensor(SLOTS)
    s_ref, before = states.clone(), states.clone()
    want = cca_conv_fn_ref(x, w0, None, w1, None, s_ref, qsl, slots, has_init)
    got = tri.cca_conv_fn_triton(x, w0, None, w1, None, states, qsl, slots, has_init)
    assert got.stride(0) == 1  # token-major in, token-major out (the layer transposes it)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(states, s_ref)
    # An empty chunk of a resumed row keeps its slot; a fresh one clears it (as the reference).
    states.copy_(before)
    s_ref.copy_(before)
    meta = (torch.tensor([0, 0, 2], dtype=torch.int32), torch.tensor([5, 2]))
    init = torch.tensor([True, False])
    want = cca_conv_fn_ref(x[:, :2], w0, None, w1, None, s_ref, *meta, init)
    got = tri.cca_conv_fn_triton(x[:, :2], w0, None, w1, None, states, *meta, init)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(states, s_ref) and torch.equal(states[5], before[5])
    # A decode batch of pad rows only: zeros, and no slot (not even scratch 0) changes.
    out = tri.cca_conv_update_triton(x[:, :3].t(), states, w0, None, w1, None, torch.full((3,), -1))
    assert not out.any() and torch.equal(states, s_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_accumulate_in_fp32(dtype: torch.dtype) -> None:
    tri = _triton()
    x, w, states, qsl, has_init = make_case(2, 2, 4, 2, 12, dtype)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    ref_states = states.clone()
    want = cca_conv_fn_ref(x, *w, ref_states, qsl, slots, has_init, PAD)
    got = tri.cca_conv_fn_triton(x, *w, states, qsl, slots, has_init, PAD)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(states, ref_states)
    xd, idx = x[:, :3].t(), torch.tensor([1, PAD, 6], dtype=torch.int32)
    want = cca_conv_update_ref(xd, ref_states, *w, idx, PAD)
    got = tri.cca_conv_update_triton(xd, states, *w, idx, PAD)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(states, ref_states)


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors run the torch path by default (a pad row sends the CPU fast path to the
    reference); SHORTCONV_KERNELS=triton forces Triton."""
    tri = _triton()
    x, w, states, qsl, has_init = make_case(3, 1, 4, 2, 8)
    slots, xd = torch.tensor(SLOTS), x[:, :3].t()
    runs = []
    for backend in ("", "triton"):
        if backend:
            monkeypatch.setenv("SHORTCONV_KERNELS", backend)
        s = states.clone()
        runs.append((cca_conv_fn(x, *w, s, qsl, slots, has_init), s))
        runs.append((cca_conv_update(xd, s, *w, slots[:3]), s.clone()))
    s_ref, s_tri = states.clone(), states.clone()
    assert torch.equal(runs[0][0], cca_conv_fn_ref(x, *w, s_ref, qsl, slots, has_init))
    assert torch.equal(runs[1][0], cca_conv_update_ref(xd, s_ref, *w, slots[:3]))
    assert torch.equal(runs[2][0], tri.cca_conv_fn_triton(x, *w, s_tri, qsl, slots, has_init))
    assert torch.equal(runs[3][0], tri.cca_conv_update_triton(xd, s_tri, *w, slots[:3]))
    assert torch.equal(runs[1][1], s_ref) and torch.equal(runs[3][1], s_tri)


def test_zaya1_greedy_tokens_same_with_triton(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: a tiny ZAYA1 through the engine (prefill + decode) gives the same greedy
    tokens with the interpreted Triton CCA kernels as with the torch reference."""
    from shortconv import LLM, SamplingParams
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    tri = _triton()
    calls = {"fn": 0, "update": 0}
    for key, name in (("fn", "cca_conv_fn_triton"), ("update", "cca_conv_update_triton")):
        real = getattr(tri, name)

        def spy(*args, _real=real, _key=key, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(tri, name, spy)
    overrides = {"cca_time0": 3, "cca_time1": 2, "num_hidden_layers": 2}
    path = make_tiny_checkpoint("zaya1", tmp_path / "zaya1", overrides, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 9, 13, 200, 7], [42, 3]]
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SHORTCONV_KERNELS", backend)  # before the build: layers bind then
        llm = LLM(model=path, dtype="float32", seed=0, enable_graphs=False)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        tokens[backend] = [o.token_ids for o in outs]
        llm.shutdown()
    assert calls["fn"] > 0 and calls["update"] > 0  # the Triton path really ran
    assert tokens["triton"] == tokens["torch"]
