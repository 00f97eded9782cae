"""The CPU fast paths equal the general paths they shortcut (bench/RESULTS.md has their gains)."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F

import shortconv.kernels.attention_cpu as attention_cpu
import shortconv.kernels.cca_ref as cca_ref
import shortconv.kernels.conv1d_ref as conv1d_ref
from shortconv.kernels.attention_cpu import paged_attention_cpu
from shortconv.kernels.attention_ref import paged_attention_ref
from shortconv.layers import linear as linear_mod
from shortconv.plan import SeqChunk, StepPlan
from shortconv.sampler import SamplingRow
from shortconv.sampling_params import SamplingParams
from shortconv.step_tensors import (
    StepScratch,
    _decode_step_tensors,
    _general_step_tensors,
    build_step_tensors,
)

PAGE = 4
ROW = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)


def plan_of(starts: list[int], lens: list[int], seed: int = 0) -> StepPlan:
    """Rows with scrambled slots and non-contiguous pages (page 0 is scratch)."""
    rng = random.Random(seed)
    pages = list(range(1, 200))
    rng.shuffle(pages)
    seqs = []
    for i, (start, n) in enumerate(zip(starts, lens, strict=True)):
        need = -(-(start + n) // PAGE) + rng.randrange(2)  # sometimes a spare page
        table, pages = tuple(pages[:need]), pages[need:]
        toks = tuple(rng.randrange(5, 50) for _ in range(n))
        sampling = ROW if i % 3 != 1 else None
        seqs.append(SeqChunk(f"r{i}", toks, start, 3 + 2 * i, table, sampling))
    return StepPlan(1, tuple(seqs))


def test_linear_onednn_path_matches_f_linear() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, linear_mod.ONEDNN_MIN_WEIGHT // 1024, generator=g)
    b = torch.randn(1024, generator=g)
    with torch.inference_mode():
        for shape in ((1, w.shape[1]), (7, w.shape[1]), (2, 5, w.shape[1])):
            x = torch.randn(*shape, generator=g)
            got = linear_mod.linear(x, w, b)
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
            assert got.shape == (*shape[:-1], 1024)
    wg = w.clone().requires_grad_(True)  # autograd keeps F.linear (the oneDNN op has none)
    assert linear_mod.linear(torch.randn(2, w.shape[1]), wg).requires_grad


def test_fused_swiglu_matches_the_plain_path() -> None:
    g = torch.Generator().manual_seed(3)
    hidden, inter = 256, linear_mod.ONEDNN_MIN_WEIGHT // 256
    w_gate, w_up = (torch.randn(inter, hidden, generator=g) / 16 for _ in range(2))
    x = torch.randn(linear_mod.FUSED_SWIGLU_MIN_ROWS, hidden, generator=g)
    with torch.inference_mode():
        got = linear_mod.silu_mul(x, w_gate, w_up)
        want = F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [7, 64, 1024 + 16])
def test_fp32_rms_norm_is_bit_equal_to_the_reference_order(dim: int) -> None:
    from shortconv.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.randn(dim, generator=g)
    x = torch.randn(33, dim, generator=g) * 3
    with torch.inference_mode():
        assert torch.equal(norm(x), norm.reference(x))
        xb = x.to(torch.bfloat16)  # other dtypes keep the reference path
        assert torch.equal(norm(xb), norm.reference(xb))


@pytest.mark.parametrize("batch", [1, 5])
def test_decode_step_tensors_equal_the_general_path(batch: int) -> None:
    """With and without kept constants, and on a scratch that served other batch sizes first."""
    scratch = StepScratch()
    for b in (batch + 2, batch, 1):
        _decode_step_tensors(plan_of([5] * b, [1] * b).seqs, PAGE, torch.device("cpu"), scratch)
    plan = plan_of([3 + 7 * i for i in range(batch)], [1] * batch, seed=batch)
    assert plan.is_decode
    slow = _general_step_tensors(plan.seqs, PAGE, torch.device("cpu"))
    for keep in (None, scratch):
        fast = _decode_step_tensors(plan.seqs, PAGE, torch.device("cpu"), keep)
        for f in fields(fast):
            a, b = getattr(fast, f.name), getattr(slow, f.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), f.name
            else:
                assert a == b, f.name


@pytest.mark.parametrize("chunk_bytes", [None, 1, 20_000])  # default; 1 and ~2 sequences a chunk
@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_cpu_attention_path_matches_the_reference(
    kind: str, chunk_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if chunk_bytes is not None:
        monkeypatch.setattr(attention_cpu, "_ATTN_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(1)
    hq, hk, d = 8, 2, 16
    plan = (
        plan_of([5, 17, 2, 30], [1, 1, 1, 1])
        if kind == "decode"
        else plan_of([0, 9, 4, 0], [6, 3, 1, 11])
    )
    step = build_step_tensors(plan, PAGE, torch.device("cpu"))
    k_cache = torch.randn(200 * PAGE, hk, d, generator=g)
    v_cache = torch.randn(200 * PAGE, hk, d, generator=g)
    q = torch.randn(step.num_tokens, hq, d, generator=g)
    scratch = StepScratch()
    for _ in range(2):  # the second call reuses the buffers and per-step values
        got = paged_attention_cpu(q, k_cache, v_cache, step, d**-0.5, scratch)
        want = paged_attention_ref(q, k_cache, v_cache, step, d**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_live_row_decode_kernels_equal_the_masked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor([4, 1, 6])
    x = torch.randn(3, 8, generator=g)
    conv = torch.randn(8, 8, 2, generator=g)
    w, bias = torch.randn(8, 3, generator=g), torch.randn(8, generator=g)
    qk = torch.randn(3, 8, generator=g)
    cca_state = torch.randn(8, 8, 2, generator=g)
    cw = (torch.randn(8, 2, generator=g), torch.randn(8, generator=g))
    gw = (torch.randn(8, 4, 2, generator=g), torch.randn(8, generator=g))
    prev = torch.randn(8, 4, generator=g)
    v = torch.randn(3, 4, generator=g)

    def run() -> list[torch.Tensor]:
        states = [conv.clone(), cca_state.clone(), prev.clone()]
        outs = [
            conv1d_ref.causal_conv1d_update_ref(x, states[0], w, bias, slots),
            cca_ref.cca_conv_update_ref(qk, states[1], *cw, *gw, slots),
            cca_ref.cca_prev_value_update_ref(v, states[2], slots),
        ]
        return outs + states

    assert conv1d_ref.all_live_cpu(slots, -1)
    fast = run()
    monkeypatch.setattr(conv1d_ref, "all_live_cpu", lambda *_: False)
    monkeypatch.setattr(cca_ref, "all_live_cpu", lambda *_: False)
    for a, b in zip(fast, run(), strict=True):
        assert torch.equal(a, b)


def test_scratch_buffer_keeps_its_storage_while_a_context_grows() -> None:
    """Decode contexts grow a token per step: the gather buffer must not be replaced (and
    page-faulted afresh) each time."""
    scratch, like = StepScratch(), torch.empty(0)
    first = scratch.buffer("k", 10_000, like)
    for n in range(10_001, 12_000, 64):
        assert scratch.buffer("k", n, like).data_ptr() == first.data_ptr()
    assert scratch.buffer("k", 10_000, like.double()).dtype == torch.float64
