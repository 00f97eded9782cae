"""Triton paged attention (decode with splits, varlen extend) against the `*_ref` oracles, and
the dispatch that wires it into the step metadata.

On CPU the kernels run under Triton's interpreter (per-test TRITON_INTERPRET; the kernels are
jitted lazily once per mode, see `attention_triton`). With a GPU the same checks also run
compiled (marked `gpu`). Every output buffer is poisoned with NaN first, so a row the kernel
forgot to write shows. Page tables are shuffled and non-contiguous, page 0 (the scratch page)
is never a live page, and context lengths sit on both sides of page and split boundaries.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from shortconv.engine.plan import SeqChunk, StepPlan  # noqa: E402
from shortconv.execution.step_inputs import DecodeShape, StepInputs  # noqa: E402
from shortconv.kernels import attention_triton, paged_attention, write_kv  # noqa: E402
from shortconv.kernels.attention_ref import (  # noqa: E402
    paged_attention_decode_ref,
    paged_attention_extend_ref,
    paged_attention_ref,
)
from shortconv.kernels.attention_triton import (  # noqa: E402
    paged_attention_decode_triton,
    paged_attention_extend_triton,
)

NUM_PAGES = 64
_SDPA = F.scaled_dot_product_attention  # the torch reference's, restored around it
NUM_KV = 2
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
# (GQA group, head_dim): ratios 1, 2, 4, 8; head_dim 64, 128 and non-powers of two 80, 96.
SHAPES = [(1, 64), (2, 128), (4, 80), (8, 96)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


def make_pool(
    head_dim: int, page: int, dtype: torch.dtype, device: str, seed: int, pages: int = NUM_PAGES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat K/V pools [pages*page, NUM_KV, d] of random values (scratch page included)."""
    g = torch.Generator().manual_seed(seed)
    shape = (pages * page, NUM_KV, head_dim)
    return tuple(torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2))


def shuffled_tables(
    seq_lens: list[int],
    page: int,
    width: int,
    idx: torch.dtype,
    device: str,
    seed: int,
    pages: int = NUM_PAGES,
) -> torch.Tensor:
    """[B, width] tables: each row's pages drawn from a shuffled pool (never page 0), then
    page 0 past them, as the step builders lay them out."""
    rng = random.Random(seed)
    free = list(range(1, pages))
    rng.shuffle(free)
    tables = torch.zeros(len(seq_lens), width, dtype=idx)
    for b, n in enumerate(seq_lens):
        need = -(-n // page)
        tables[b, :need] = torch.tensor(free[:need])
        free = free[need:]
    return tables.to(device)


def nan_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


# Decode context lengths for page 16 and a 12-page table (192 positions): 1, both sides of
# page boundaries (15/16/17: partly filled last pages) and of the 64-position split
# boundaries that 3 splits give (63/64/65, 128/129), up to the full table.
DECODE_LENS = [1, 15, 16, 17, 63, 64, 65, 128, 129, 192]


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("group,head_dim", SHAPES)
def test_decode_matches_ref(
    device: str, group: int, head_dim: int, dtype: torch.dtype, num_splits: int | None
) -> None:
    page, width = 16, 12
    idx = torch.int32 if group % 2 else torch.int64  # both index widths reach the kernel
    k_cache, v_cache = make_pool(head_dim, page, dtype, device, seed=group)
    tables = shuffled_tables(DECODE_LENS, page, width, idx, device, seed=head_dim)
    seq_lens = torch.tensor(DECODE_LENS, dtype=idx, device=device)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(len(DECODE_LENS), group * NUM_KV, head_dim, generator=g).to(dtype).to(device)
    scale = head_dim**-0.5
    want = paged_attention_decode_ref(q, k_cache, v_cache, tables, seq_lens, scale, page)
    out = nan_like(q)
    got = paged_attention_decode_triton(
        q,
        k_cache,
        v_cache,
        tables,
        seq_lens,
        scale,
        page,
        out=out,
        num_splits=num_splits,
        min_split_len=attention_triton._DECODE_BLOCK_N,  # block-sized splits: boundaries at 64
    )
    assert got is out and not out.isnan().any()
    torch.testing.assert_close(out, want, **TOL[dtype])


@pytest.mark.parametrize("page", [4, 32])
def test_decode_auto_splits_over_long_contexts(device: str, page: int) -> None:
    """One sequence alone gets several splits by default; contexts cross their boundaries."""
    head_dim, width = 64, 1024 // page
    lens, pages = [1023, 257, 256, 1], 2 * 1024 // page
    k_cache, v_cache = make_pool(head_dim, page, torch.float32, device, seed=page, pages=pages)
    for batch in (1, 4):
        sel = lens[:batch]
        tables = shuffled_tables(sel, page, width, torch.int32, device, seed=batch, pages=pages)
        seq_lens = torch.tensor(sel, dtype=torch.int32, device=device)
        q = torch.randn(batch, 4 * NUM_KV, head_dim).to(device)
        split_count = attention_triton.decode_splits(batch, NUM_KV, width * page, q.device)
        if batch == 1 and device == "cpu":
            assert split_count > 1  # the reduce kernel really runs
        want = paged_attention_decode_ref(q, k_cache, v_cache, tables, seq_lens, 0.1, page)
        got = paged_attention_decode_triton(
            q, k_cache, v_cache, tables, seq_lens, 0.1, page, out=nan_like(q)
        )
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_decode_splits_follow_each_rows_length(device: str) -> None:
    """A row's splits divide its own context, not the table: the same rows in a table 8x
    wider (one max_model_len graph bucket instead of a bucket of their size) give bit-identical
    outputs at the same split count. Splitting by table width would put all of a short row in
    split 0 (other boundaries, other rounding) and leave the other splits idle."""
    page, head_dim, splits = 16, 64, 4
    lens = [1, 63, 65, 129, 256]
    k_cache, v_cache = make_pool(head_dim, page, torch.float32, device, seed=3)
    narrow = shuffled_tables(lens, page, 16, torch.int32, device, seed=8)
    wide = torch.cat([narrow, narrow.new_zeros(len(lens), 7 * 16)], dim=1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), 2 * NUM_KV, head_dim).to(device)
    outs = [
        paged_attention_decode_triton(
            q,
            k_cache,
            v_cache,
            tables,
            seq_lens,
            0.1,
            page,
            out=nan_like(q),
            num_splits=splits,
            min_split_len=attention_triton._DECODE_BLOCK_N,
        )
        for tables in (narrow, wide)
    ]
    assert torch.equal(outs[0], outs[1])
    want = paged_attention_decode_ref(q, k_cache, v_cache, narrow, seq_lens, 0.1, page)
    torch.testing.assert_close(outs[1], want, **TOL[torch.float32])


# Extend rows (start position, new tokens): a fresh prefill crossing pages and query blocks,
# a resumed prefix read from its pages, a decode row, a one-token fresh sequence, a chunk whose
# context ends mid-page.
EXTEND_ROWS = [(0, 20), (37, 9), (50, 1), (0, 1), (16, 17)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("group,head_dim", SHAPES)
def test_extend_matches_ref(device: str, group: int, head_dim: int, dtype: torch.dtype) -> None:
    page = 8
    idx = torch.int64 if group % 2 else torch.int32
    lens = [s + n for s, n in EXTEND_ROWS]
    width = -(-max(lens) // page)
    k_cache, v_cache = make_pool(head_dim, page, dtype, device, seed=head_dim)
    tables = shuffled_tables(lens, page, width, idx, device, seed=group)
    seq_lens = torch.tensor(lens, dtype=idx, device=device)
    counts = torch.tensor([n for _, n in EXTEND_ROWS])
    qsl = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32).to(device)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(int(counts.sum()), group * NUM_KV, head_dim, generator=g).to(dtype).to(device)
    args = (q, k_cache, v_cache, tables, seq_lens, qsl, head_dim**-0.5, page)
    want = paged_attention_extend_ref(*args, max_query_len=int(counts.max()))
    out = nan_like(q)
    got = paged_attention_extend_triton(*args, max_query_len=int(counts.max()), out=out)
    assert got is out and not out.isnan().any()
    torch.testing.assert_close(out, want, **TOL[dtype])


def test_extend_leaves_rows_past_the_packed_tokens(device: str) -> None:
    """Rows past query_start_loc[-1] (a padded token count) are not written."""
    page, head_dim = 4, 64
    k_cache, v_cache = make_pool(head_dim, page, torch.float32, device, seed=1)
    tables = shuffled_tables([6, 3], page, 2, torch.int32, device, seed=1)
    seq_lens = torch.tensor([6, 3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 4, 7], dtype=torch.int32, device=device)
    q = torch.randn(10, 2 * NUM_KV, head_dim).to(device)
    out = nan_like(q)
    paged_attention_extend_triton(
        q, k_cache, v_cache, tables, seq_lens, qsl, 0.125, page, max_query_len=4, out=out
    )
    assert not out[:7].isnan().any() and out[7:].isnan().all()
    want = paged_attention_extend_ref(
        q[:7], k_cache, v_cache, tables, seq_lens, qsl, 0.125, page, max_query_len=4
    )
    torch.testing.assert_close(out[:7], want, **TOL[torch.float32])


def _graph_like_step(
    live: list[int], num_pads: int, page: int, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tables, seq_lens, slot_mapping) of a decode step whose rows past `live` are scratch
    rows as a padded graph bucket lays them out: page 0, position 0 (seq_len 1)."""
    lens = live + [1] * num_pads
    width = -(-max(lens) // page)
    tables = shuffled_tables(live, page, width, torch.int32, device, seed)
    tables = torch.cat([tables, tables.new_zeros(num_pads, width)])
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    pos = seq_lens - 1
    rows = tables.gather(1, (pos // page)[:, None])[:, 0].to(torch.int64) * page + pos % page
    return tables, seq_lens, rows


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_padded_rows_touch_only_the_scratch_page(device: str, dtype: torch.dtype) -> None:
    """A padded decode step (KV write, then attention) leaves every page but page 0 and the
    live rows' new positions bit-identical, and live outputs equal the unpadded step's bit for
    bit (same split count), so padding never leaks into a live request."""
    page, head_dim, group, live = 4, 64, 4, [9, 4, 13]
    k_cache, v_cache = make_pool(head_dim, page, dtype, device, seed=5)
    g = torch.Generator().manual_seed(11)
    b_max = len(live) + 5
    new_k, new_v = (torch.randn(b_max, NUM_KV, head_dim, generator=g) for _ in range(2))
    q = torch.randn(b_max, group * NUM_KV, head_dim, generator=g).to(dtype).to(device)
    outs = []
    for pads in (0, 5):
        tables, seq_lens, rows = _graph_like_step(live, pads, page, device, seed=2)
        b = len(live) + pads
        k, v = k_cache.clone(), v_cache.clone()
        write_kv(new_k[:b].to(device), new_v[:b].to(device), k, v, rows)
        out = paged_attention_decode_triton(
            q[:b],
            k,
            v,
            tables,
            seq_lens,
            0.125,
            page,
            out=nan_like(q[:b]),
            num_splits=2,
            min_split_len=attention_triton._DECODE_BLOCK_N,
        )
        assert not out.isnan().any()
        written = torch.zeros(k.shape[0], dtype=torch.bool, device=device)
        written[rows] = True
        assert written[:page].any() == bool(pads)  # pad rows wrote the scratch page only
        written[:page] = True
        for new, old in ((k, k_cache), (v, v_cache)):
            assert torch.equal(new[~written], old[~written])
        outs.append(out[: len(live)])
    assert torch.equal(outs[0], outs[1])


# ---- the wiring: StepTensors -> dispatch -> kernels ------------------------------------------


def _plan(rows: list[tuple[int, int]], page: int, seed: int) -> StepPlan:
    """Rows (start, new tokens) with scrambled slots and shuffled pages (a spare one at times)."""
    rng = random.Random(seed)
    free = list(range(1, NUM_PAGES))
    rng.shuffle(free)
    seqs = []
    for i, (start, n) in enumerate(rows):
        need = -(-(start + n) // page) + rng.randrange(2)
        table, free = tuple(free[:need]), free[need:]
        toks = tuple(rng.randrange(5, 50) for _ in range(n))
        seqs.append(SeqChunk(f"r{i}", toks, start, 9 - i, table, None))
    return StepPlan(1, tuple(seqs))


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """SHORTCONV_KERNELS=triton with the two kernels counted and torch SDPA forbidden."""
    monkeypatch.setenv("SHORTCONV_KERNELS", "triton")
    calls = {"decode": 0, "extend": 0}

    def counting(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapper(*a: Any, **kw: Any) -> torch.Tensor:
            calls[name] += 1
            return fn(*a, **kw)

        return wrapper

    monkeypatch.setattr(
        attention_triton,
        "paged_attention_decode_triton",
        counting("decode", paged_attention_decode_triton),
    )
    monkeypatch.setattr(
        attention_triton,
        "paged_attention_extend_triton",
        counting("extend", paged_attention_extend_triton),
    )

    def no_sdpa(*a: Any, **kw: Any) -> torch.Tensor:
        raise AssertionError("torch SDPA called under SHORTCONV_KERNELS=triton")

    monkeypatch.setattr(F, "scaled_dot_product_attention", no_sdpa)
    return calls


@pytest.mark.parametrize(
    "rows,kernel",
    [
        ([(5, 1), (17, 1), (2, 1), (30, 1)], "decode"),  # the decode builder
        ([(0, 6), (9, 3), (4, 1), (0, 11)], "extend"),  # prefill, resumed chunk, decode row
        ([(0, 1), (0, 1)], "decode"),  # one-token fresh prompts: still one query per row
    ],
)
def test_dispatch_runs_the_kernels_from_step_tensors(
    device: str, counted: dict[str, int], rows: list[tuple[int, int]], kernel: str
) -> None:
    page, head_dim = 4, 80
    plan = _plan(rows, page, seed=len(rows))
    step = StepInputs(page, torch.device(device)).build(plan)
    assert step.block_tables.dtype == torch.int32 and step.page_size == page
    assert step.block_tables.shape == (len(rows), -(-step.max_seq_len // page))
    k_cache, v_cache = make_pool(head_dim, page, torch.float32, device, seed=4)
    q = torch.randn(step.num_tokens, 4 * NUM_KV, head_dim).to(device)
    got = paged_attention(q, k_cache, v_cache, step, 0.1)
    assert counted == {"decode": int(kernel == "decode"), "extend": int(kernel == "extend")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHORTCONV_KERNELS", "torch")
        mp.setattr(F, "scaled_dot_product_attention", _SDPA)
        want = paged_attention_ref(q, k_cache, v_cache, step, 0.1)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_static_buffers_feed_the_decode_kernel(device: str, counted: dict[str, int]) -> None:
    """A graph bucket's step (refresh + derive) gives the kernel the same page table as an
    eager step padded with scratch rows, and the same outputs for the live rows."""
    page, head_dim, shape = 4, 64, DecodeShape(batch=4, context=32)
    plan = _plan([(8, 1), (20, 1), (3, 1)], page, seed=9)
    bufs = StepInputs(page, torch.device(device))
    bufs.reserve(8, 8, 64)
    bufs.refresh(plan, shape)
    bufs.derive(shape)
    static = bufs.graph_step(shape)
    pad = SeqChunk("pad", (0,), 0, 0, (0,), None)  # position 0 on page 0, like a bucket's pad
    padded = StepPlan(1, plan.seqs + (pad,))
    eager = StepInputs(page, torch.device(device)).build(padded)
    width = -(-shape.context // page)
    extra = width - eager.block_tables.shape[1]
    eager = replace(eager, block_tables=F.pad(eager.block_tables, (0, extra), value=0))
    assert torch.equal(static.block_tables, eager.block_tables)
    assert torch.equal(static.seq_lens, eager.seq_lens)
    k_cache, v_cache = make_pool(head_dim, page, torch.float32, device, seed=6)
    q = torch.randn(4, 2 * NUM_KV, head_dim).to(device)
    a = paged_attention(q, k_cache, v_cache, static, 0.1)
    b = paged_attention(q, k_cache, v_cache, eager, 0.1)
    assert counted["decode"] == 2 and torch.equal(a, b)


def test_refresh_writes_only_the_pages_the_plan_covers(device: str) -> None:
    """In a bucket as wide as max_model_len, refresh zeroes and copies B x w table entries (w:
    the pages of the plan's longest context), not B x ceil(L / page); derive still gives the
    kernels the full-width table an eager step padded with scratch rows would have."""
    page, shape = 4, DecodeShape(batch=4, context=1024)
    plan = _plan([(8, 1), (20, 1), (3, 1)], page, seed=5)
    bufs = StepInputs(page, torch.device(device))
    bufs.reserve(4, 4, 1024)
    for t in (bufs.primary_host, bufs.primary):
        t.fill_(-7)  # a sentinel refresh must leave alone past the plan's pages
    bufs.refresh(plan, shape)
    bufs.derive(shape)
    width = -(-21 // page)  # the longest context: 20 + 1 positions
    # ids, positions, token rows, KV rows, slots, seq_lens, has_initial_state [B] each;
    # qsl [B+1]; logits rows [B]; the width; then the compact table [B, w].
    used = 9 * shape.batch + 2 + shape.batch * width
    for t in (bufs.primary_host, bufs.primary):
        assert bool((t[used:] == -7).all()) and not bool((t[:used] == -7).any())
    pad = SeqChunk("pad", (0,), 0, 0, (0,), None)
    padded = StepPlan(1, plan.seqs + (pad,))
    eager = StepInputs(page, torch.device(device)).build(padded)
    wide = F.pad(eager.block_tables, (0, 1024 // page - eager.block_tables.shape[1]), value=0)
    static = bufs.graph_step(shape)
    assert torch.equal(static.block_tables, wide)
    assert torch.equal(static.slot_mapping, eager.slot_mapping)


@pytest.mark.parametrize("rows", [[(5, 1), (17, 1), (2, 1)], [(5, 1), (0, 3), (9, 4)]])
def test_torch_path_derives_its_layout_from_the_block_tables(
    device: str, rows: list[tuple[int, int]]
) -> None:
    """The step carries no dense gather or mask: the torch attention path derives them from
    the same block tables the paged kernels read, and agrees with the per-sequence oracles."""
    page, head_dim = 4, 16
    plan = _plan(rows, page, seed=len(rows))
    step = StepInputs(page, torch.device(device)).build(plan)
    assert not hasattr(step, "dense") and not hasattr(step, "kv_gather")
    k_cache, v_cache = make_pool(head_dim, page, torch.float32, device, seed=1)
    q = torch.randn(step.num_tokens, 2 * NUM_KV, head_dim).to(device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHORTCONV_KERNELS", "torch")
        got = paged_attention(q, k_cache, v_cache, step, 0.1)
    oracle = paged_attention_decode_ref if step.max_query_len == 1 else paged_attention_extend_ref
    args = (q, k_cache, v_cache, step.block_tables, step.seq_lens)
    if step.max_query_len == 1:
        want = oracle(*args, 0.1, page)
    else:
        want = oracle(*args, step.query_start_loc, 0.1, page, max_query_len=step.max_query_len)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
