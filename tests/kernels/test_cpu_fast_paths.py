"""The CPU fast paths equal the general paths they shortcut (bench/RESULTS.md has their gains)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shortconv.kernels.attention_cpu as attention_cpu
import shortconv.kernels.cca_cpu as cca_cpu
import shortconv.kernels.conv1d_cpu as conv1d_cpu
import shortconv.kernels.dispatch as dispatch
from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.execution.parallel import ParallelContext
from shortconv.execution.step_inputs import StepInputs
from shortconv.execution.step_tensors import StepTensors
from shortconv.kernels.attention_cpu import paged_attention_cpu
from shortconv.kernels.attention_dense import dense_indices
from shortconv.kernels.attention_ref import paged_attention_ref
from shortconv.kernels.cca_ref import cca_conv_update_ref, cca_prev_value_update_ref
from shortconv.kernels.conv1d_ref import causal_conv1d_update_ref
from shortconv.kernels.scratch import StepScratch
from shortconv.layers import linear as linear_mod
from shortconv.layers import linear_float
from shortconv.layers.linear import ColumnParallelLinear
from shortconv.sampling.sampler import SamplingRow
from shortconv.sampling.sampling_params import SamplingParams

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


def _onednn_layer(out_f: int, in_f: int, seed: int, bias: bool) -> ColumnParallelLinear:
    """A layer bound as the engine binds a large fp32 CPU weight (plain oneDNN)."""
    layer = ColumnParallelLinear(in_f, out_f, bias, ParallelContext()).requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=g) / 16)
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(out_f, generator=g))
    layer.method = linear_float.cpu_float_method(layer.weight, prepack=False)
    return layer


def test_linear_onednn_path_matches_f_linear() -> None:
    g = torch.Generator().manual_seed(0)
    layer = _onednn_layer(1024, linear_float.ONEDNN_MIN_WEIGHT // 1024, 0, bias=True)
    assert layer.method == linear_float.OneDnnLinear(plain=True, prepack=False)
    w, b = layer.weight, layer.bias
    with torch.inference_mode():
        for shape in ((1, w.shape[1]), (7, w.shape[1]), (2, 5, w.shape[1])):
            x = torch.randn(*shape, generator=g)
            got = layer(x)
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
            assert got.shape == (*shape[:-1], 1024)
    wg = w.clone().requires_grad_(True)  # autograd keeps F.linear (the oneDNN op has none)
    assert linear_float.dense_linear(torch.randn(2, w.shape[1]), wg).requires_grad


def test_fused_swiglu_matches_the_plain_path() -> None:
    g = torch.Generator().manual_seed(3)
    hidden, inter = 256, linear_float.ONEDNN_MIN_WEIGHT // 256
    gate, up = (_onednn_layer(inter, hidden, seed, bias=False) for seed in (1, 2))
    x = torch.randn(linear_mod.FUSED_SWIGLU_MIN_ROWS, hidden, generator=g)
    with torch.inference_mode():
        got = linear_mod.silu_mul(x, gate, up)
        want = F.silu(F.linear(x, gate.weight)) * F.linear(x, up.weight)
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


def _reference_step(plan: StepPlan) -> dict[str, list]:
    """The step's fields from the plan, by hand (plain Python, one row at a time)."""
    seqs, ref = plan.seqs, {}
    ref["input_ids"] = [t for s in seqs for t in s.token_ids]
    ref["positions"] = [s.start_pos + j for s in seqs for j in range(s.num_tokens)]
    ref["token_seq_index"] = [b for b, s in enumerate(seqs) for _ in range(s.num_tokens)]
    ref["query_start_loc"] = [sum(s.num_tokens for s in seqs[:b]) for b in range(len(seqs) + 1)]
    ref["cache_indices"] = [s.slot for s in seqs]
    ref["has_initial_state"] = [s.start_pos > 0 for s in seqs]
    ref["seq_lens"] = [s.start_pos + s.num_tokens for s in seqs]
    ref["slot_mapping"] = [
        s.block_table[p // PAGE] * PAGE + p % PAGE
        for s in seqs
        for p in range(s.start_pos, s.start_pos + s.num_tokens)
    ]
    ends = ref["query_start_loc"][1:]
    ref["logits_indices"] = [e - 1 for e, s in zip(ends, seqs, strict=True) if s.sampling]
    width = -(-max(ref["seq_lens"]) // PAGE)
    ref["block_tables"] = [(list(s.block_table) + [0] * width)[:width] for s in seqs]
    return ref


def _reference_dense(step: StepTensors) -> tuple[list, list, list, list]:
    """(kv_gather, attn_mask, q_pad_index, q_unpad_index) of the torch path, by hand."""
    qsl, lens = step.query_start_loc_cpu.tolist(), step.seq_lens_cpu.tolist()
    tables, max_q, length = step.block_tables.tolist(), step.max_query_len, step.max_seq_len
    gather, mask, q_pad, q_unpad = [], [], [], []
    for b, table in enumerate(tables):
        n = qsl[b + 1] - qsl[b]
        start = lens[b] - n
        gather.append(
            [table[c // PAGE] * PAGE + c % PAGE if c < lens[b] else 0 for c in range(length)]
        )
        rows = [
            [c <= start + q for c in range(length)] if q < n else [c == 0 for c in range(length)]
            for q in range(max_q)
        ]
        mask.append(rows)
        q_pad += [qsl[b] + q if q < n else step.num_tokens for q in range(max_q)]
        q_unpad += [b * max_q + q for q in range(n)]
    return gather, mask, q_pad, q_unpad


@pytest.mark.parametrize("order", ["fresh", "reused"])
@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_step_inputs_equal_a_hand_built_step(kind: str, order: str) -> None:
    """The one builder's eager step (and the torch path's dense layout derived from it) equals
    the plan worked out by hand, on fresh buffers and on buffers that served larger, wider and
    smaller steps first (stale contents past the step must not leak in)."""
    inputs = StepInputs(PAGE, torch.device("cpu"))
    if order == "reused":
        for warm in (plan_of([40, 0], [1, 30], seed=7), plan_of([5] * 9, [1] * 9, seed=8)):
            dense_indices(inputs.build(warm))
    decode = kind == "decode"
    starts, lens = ([3, 17, 1, 30, 8], [1] * 5) if decode else ([0, 9, 4, 0], [6, 3, 1, 11])
    plan = plan_of(starts, lens, seed=len(starts))
    step = inputs.build(plan)
    assert step.is_decode == decode == plan.is_decode
    for name, want in _reference_step(plan).items():
        got = getattr(step, name)
        assert got.tolist() == want, name
    assert step.query_start_loc.dtype == step.block_tables.dtype == torch.int32
    assert step.cache_indices.dtype == step.slot_mapping.dtype == torch.int64
    assert torch.equal(step.query_start_loc_cpu, step.query_start_loc)
    assert torch.equal(step.has_initial_state_cpu, step.has_initial_state)
    dense = dense_indices(step)
    got = (dense.kv_gather, dense.attn_mask, dense.q_pad_index, dense.q_unpad_index)
    for name, g, want in zip(
        ("gather", "mask", "q_pad", "q_unpad"), got, _reference_dense(step), strict=True
    ):
        assert g.tolist() == want, name


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
    step = StepInputs(PAGE, torch.device("cpu")).build(plan)
    k_cache = torch.randn(200 * PAGE, hk, d, generator=g)
    v_cache = torch.randn(200 * PAGE, hk, d, generator=g)
    q = torch.randn(step.num_tokens, hq, d, generator=g)
    scratch = StepScratch()
    for _ in range(2):  # the second call reuses the buffers and per-step values
        got = paged_attention_cpu(q, k_cache, v_cache, step, d**-0.5, scratch)
        want = paged_attention_ref(q, k_cache, v_cache, step, d**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("starts", [[12], [5, 17, 30]], ids=["one", "three"])
def test_uniform_chunks_take_q_as_is_and_equal_the_general_path(
    starts: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify-shaped steps (every row 5 queries): the result equals the reference, and the
    general path (zero row, gather, scatter) bit for bit."""
    g = torch.Generator().manual_seed(2)
    hq, hk, d = 8, 2, 16
    step = StepInputs(PAGE, torch.device("cpu")).build(plan_of(starts, [5] * len(starts)))
    k_cache = torch.randn(200 * PAGE, hk, d, generator=g)
    v_cache = torch.randn(200 * PAGE, hk, d, generator=g)
    # q as a column slice of a fused projection's output (not contiguous), as layers pass it
    q = torch.randn(step.num_tokens, 3 * hq * d, generator=g)[:, : hq * d].view(-1, hq, d)
    calls: list[bool] = []
    real = attention_cpu._uniform_chunks

    def spy(*args: Any) -> bool:
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(attention_cpu, "_uniform_chunks", spy)
    got = paged_attention_cpu(q, k_cache, v_cache, step, d**-0.5, StepScratch())
    assert calls == [True]
    want = paged_attention_ref(q, k_cache, v_cache, step, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(attention_cpu, "_uniform_chunks", lambda *_: False)
    general = paged_attention_cpu(q, k_cache, v_cache, step, d**-0.5, StepScratch())
    assert torch.equal(got, general)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "slot_list,fast",
    [([4, 1, 6], True), ([4, -1, 6], False), ([4, 0, 6], False)],
    ids=["live", "pad", "scratch"],
)
def test_cpu_decode_conv_paths_equal_the_reference(
    slot_list: list[int], fast: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """conv1d_cpu / cca_cpu against the `*_ref` oracles, bit for bit (same fp32 arithmetic):
    an all-live batch takes the fast path, a pad row or a scratch-slot row (a graph bucket's
    padding) hands the whole batch to the reference."""
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor(slot_list)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) + 0.3).to(dtype)

    x, conv, w, bias = rnd(3, 8), rnd(8, 8, 2), rnd(8, 3), rnd(8)
    qk, cca_state = rnd(3, 8), rnd(8, 8, 2)
    cw, gw = (rnd(8, 2), rnd(8)), (rnd(8, 4, 2), rnd(8))  # t0 = t1 = 2, two groups of 4
    prev, v = rnd(8, 4), rnd(3, 4)

    refs = {"conv": 0, "cca": 0, "prev": 0}
    for mod, key, name in (
        (conv1d_cpu, "conv", "causal_conv1d_update_ref"),
        (cca_cpu, "cca", "cca_conv_update_ref"),
        (cca_cpu, "prev", "cca_prev_value_update_ref"),
    ):
        real = getattr(mod, name)

        def counted(*a: Any, _real: Any = real, _key: str = key, **kw: Any) -> torch.Tensor:
            refs[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, counted)

    def run(cpu: bool) -> list[torch.Tensor]:
        conv_fn = conv1d_cpu.causal_conv1d_update_cpu if cpu else causal_conv1d_update_ref
        cca_fn = cca_cpu.cca_conv_update_cpu if cpu else cca_conv_update_ref
        prev_fn = cca_cpu.cca_prev_value_update_cpu if cpu else cca_prev_value_update_ref
        states = [conv.clone(), cca_state.clone(), prev.clone()]
        outs = [torch.full(x.shape, float("nan"), dtype=dtype) for _ in range(2)]
        got = [
            conv_fn(x, states[0], w, bias, slots, out=outs[0]),
            cca_fn(qk, states[1], *cw, *gw, slots, out=outs[1]),
            prev_fn(v, states[2], slots),
        ]
        assert got[0] is outs[0] and got[1] is outs[1]
        return got + states

    assert conv1d_cpu.all_live_cpu(slots, -1) == fast
    got = run(cpu=True)
    assert refs == dict.fromkeys(refs, 0 if fast else 1)
    want = run(cpu=False)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), i
    if not fast:  # the pad row: zero outputs
        assert slot_list[1] == 0 or not any(t[1].any() for t in got[:3])
    # No bias, and an empty batch (the early returns keep the reference's results).
    s_cpu, s_ref = conv.clone(), conv.clone()
    got = conv1d_cpu.causal_conv1d_update_cpu(x, s_cpu, w, None, slots)
    assert torch.equal(got, causal_conv1d_update_ref(x, s_ref, w, None, slots))
    assert torch.equal(s_cpu, s_ref)
    no_bias = (cw[0], None, gw[0], None)
    s_cpu, s_ref = cca_state.clone(), cca_state.clone()
    got = cca_cpu.cca_conv_update_cpu(qk, s_cpu, *no_bias, slots)
    assert torch.equal(got, cca_conv_update_ref(qk, s_ref, *no_bias, slots))
    assert torch.equal(s_cpu, s_ref)
    none = slots[:0]
    assert conv1d_cpu.causal_conv1d_update_cpu(x[:0], conv, w, bias, none).shape == (0, 8)
    assert cca_cpu.cca_conv_update_cpu(qk[:0], cca_state, *cw, *gw, none).shape == (0, 8)
    assert cca_cpu.cca_prev_value_update_cpu(v[:0], prev, none).shape == (0, 4)


@pytest.mark.parametrize("env", [None, "torch", "triton"])
def test_dispatch_picks_the_cpu_decode_paths(
    env: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Torch backend: the CPU fast path for CPU tensors, the reference on any other device;
    the Triton backend (CUDA, or forced) keeps its kernels. The previous-token value has no
    Triton twin and runs its CPU path on CPU tensors whatever the backend."""
    if env is None:
        monkeypatch.delenv("SHORTCONV_KERNELS", raising=False)
    else:
        monkeypatch.setenv("SHORTCONV_KERNELS", env)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cases = [
        (
            "causal_conv1d_update_triton",
            causal_conv1d_update_ref,
            "conv1d_triton",
            conv1d_cpu.causal_conv1d_update_cpu,
        ),
        ("cca_conv_update_triton", cca_conv_update_ref, "cca_triton", cca_cpu.cca_conv_update_cpu),
    ]
    for name, ref, module, fast in cases:
        if env == "triton":
            pytest.importorskip("triton")
            assert dispatch._pick(cpu, name, ref, module, cpu=fast).__name__ == name
        else:
            assert dispatch._pick(cpu, name, ref, module, cpu=fast) is fast
        if env == "torch":
            assert dispatch._pick(cuda, name, ref, module, cpu=fast) is ref

    calls = []
    monkeypatch.setattr(conv1d_cpu, "all_live_cpu", lambda *a: calls.append(a) or False)
    monkeypatch.setattr(cca_cpu, "all_live_cpu", lambda *a: calls.append(a) or False)
    prev = torch.randn(4, 3)
    out = dispatch.cca_prev_value_update(torch.ones(2, 3), prev, torch.tensor([1, 2]))
    assert len(calls) == 1 and torch.equal(prev[1:3], torch.ones(2, 3)) and out.shape == (2, 3)
    if env != "triton":
        conv = torch.randn(4, 5, 2)
        dispatch.causal_conv1d_update(
            torch.randn(2, 5), conv, torch.randn(5, 3), None, torch.tensor([1, 2])
        )
        assert len(calls) == 2


def test_scratch_buffer_keeps_its_storage_while_a_context_grows() -> None:
    """Decode contexts grow a token per step: the gather buffer must not be replaced (and
    page-faulted afresh) each time."""
    scratch, like = StepScratch(), torch.empty(0)
    first = scratch.buffer("k", 10_000, like)
    for n in range(10_001, 12_000, 64):
        assert scratch.buffer("k", n, like).data_ptr() == first.data_ptr()
    assert scratch.buffer("k", 10_000, like.double()).dtype == torch.float64
