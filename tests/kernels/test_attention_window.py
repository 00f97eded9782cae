"""Sliding-window paged attention (`window` > 0) on every path: the per-sequence oracles
against a hand-written masked softmax, the Triton decode and extend kernels and the torch paths
(CPU fast path, SDPA reference) against the oracles, and the dispatch mixing window-0 and
windowed layers on one step's scratch.

NOTE: every windowed case frees the pages wholly before each row's first window (block-table
entry -> scratch page 0, as the window-aware KV pool lays them out) and fills page 0 with NaN:
a path that reads a position outside the window, even masked, then returns NaN (NaN * 0 = NaN).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from shortconv.engine.plan import SeqChunk, StepPlan  # noqa: E402
from shortconv.execution.step_inputs import StepInputs  # noqa: E402
from shortconv.kernels import paged_attention  # noqa: E402
from shortconv.kernels.attention_cpu import paged_attention_cpu  # noqa: E402
from shortconv.kernels.attention_ref import (  # noqa: E402
    paged_attention_decode_ref,
    paged_attention_extend_ref,
    paged_attention_ref,
)
from shortconv.kernels.attention_triton import (  # noqa: E402
    paged_attention_decode_triton,
    paged_attention_extend_triton,
)
from shortconv.kernels.scratch import StepScratch  # noqa: E402

NUM_PAGES = 48
NUM_KV, GROUP, HEAD_DIM = 2, 2, 32
TOL = dict(rtol=1e-5, atol=1e-5)
# (page size, window): inside one page, spanning pages at a multiple of the page size and not,
# and larger than every context below.
WINDOWS = [(16, 3), (4, 8), (4, 6), (8, 13), (4, 1000)]
DECODE_LENS = [1, 3, 5, 9, 17, 40, 70]
# (start position, new tokens): a fresh prefill longer than most windows, a resumed chunk deep
# in the context, a decode row, a one-token fresh sequence, a chunk ending mid-page.
EXTEND_ROWS = [(0, 21), (37, 9), (50, 1), (0, 1), (15, 6)]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_pool(page: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V pools [NUM_PAGES*page, NUM_KV, HEAD_DIM], page 0 (scratch) filled with NaN."""
    g = torch.Generator().manual_seed(seed)
    pools = []
    for _ in range(2):
        pool = torch.randn(NUM_PAGES * page, NUM_KV, HEAD_DIM, generator=g).to(dtype)
        pool[:page] = float("nan")
        pools.append(pool)
    return pools[0], pools[1]


def tables_of(lens: list[int], page: int, seed: int) -> torch.Tensor:
    """[B, width] tables of shuffled live pages (never page 0), page 0 past each row's pages."""
    rng = random.Random(seed)
    free = list(range(1, NUM_PAGES))
    rng.shuffle(free)
    width = -(-max(lens) // page)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(lens):
        need = -(-n // page)
        tables[b, :need] = torch.tensor(free[:need])
        free = free[need:]
    return tables


def freed(tables: torch.Tensor, firsts: list[int], page: int) -> torch.Tensor:
    """`tables` with each row's pages wholly before its first visible position set to 0."""
    out = tables.clone()
    for b, first in enumerate(firsts):
        out[b, : first // page] = 0
    return out


def oracle(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: list[int],
    positions: list[int],
    page: int,
    window: int,
) -> torch.Tensor:
    """Hand-written masked softmax: q [n, Hq, d] at `positions`, each over its window only."""
    outs = []
    for i, p in enumerate(positions):
        seen = range(max(0, p - window + 1), p + 1)
        rows = torch.tensor([table[s // page] * page + s % page for s in seen])
        keys = k_cache[rows].float().repeat_interleave(GROUP, dim=1)  # [w, Hq, d]
        values = v_cache[rows].float().repeat_interleave(GROUP, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].float(), keys) * HEAD_DIM**-0.5
        outs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values))
    return torch.stack(outs)


def decode_case(page: int, window: int, dtype: torch.dtype = torch.float32) -> tuple:
    """(q, k_cache, v_cache, full tables, freed tables, seq_lens) of a windowed decode step."""
    k_cache, v_cache = make_pool(page, dtype, seed=page + window)
    full = tables_of(DECODE_LENS, page, seed=window)
    firsts = [max(0, n - window) for n in DECODE_LENS]
    seq_lens = torch.tensor(DECODE_LENS)
    g = torch.Generator().manual_seed(window)
    q = torch.randn(len(DECODE_LENS), GROUP * NUM_KV, HEAD_DIM, generator=g).to(dtype)
    return q, k_cache, v_cache, full, freed(full, firsts, page), seq_lens


@pytest.mark.parametrize("page,window", WINDOWS)
def test_decode_ref_is_the_windowed_softmax(page: int, window: int) -> None:
    q, k_cache, v_cache, full, table, seq_lens = decode_case(page, window)
    got = paged_attention_decode_ref(
        q, k_cache, v_cache, table, seq_lens, HEAD_DIM**-0.5, page, window=window
    )
    for b, n in enumerate(DECODE_LENS):
        want = oracle(q[b : b + 1], k_cache, v_cache, full[b].tolist(), [n - 1], page, window)
        torch.testing.assert_close(got[b : b + 1], want, **TOL)
    if window >= max(DECODE_LENS):  # a window past every context is the whole context
        k_ok, v_ok = k_cache.nan_to_num(), v_cache.nan_to_num()
        whole = paged_attention_decode_ref(q, k_ok, v_ok, full, seq_lens, HEAD_DIM**-0.5, page)
        torch.testing.assert_close(got, whole, **TOL)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("page,window", WINDOWS)
def test_decode_kernel_matches_ref(page: int, window: int, num_splits: int | None) -> None:
    q, k_cache, v_cache, _, table, seq_lens = decode_case(page, window)
    args = (q, k_cache, v_cache, table, seq_lens, HEAD_DIM**-0.5, page)
    want = paged_attention_decode_ref(*args, window=window)
    out = torch.full_like(q, float("nan"))
    paged_attention_decode_triton(
        *args, out=out, num_splits=num_splits, min_split_len=4, window=window
    )
    torch.testing.assert_close(out, want, **TOL)


def test_decode_kernel_bf16_window() -> None:
    q, k_cache, v_cache, _, table, seq_lens = decode_case(4, 6, torch.bfloat16)
    args = (q, k_cache, v_cache, table, seq_lens, HEAD_DIM**-0.5, 4)
    want = paged_attention_decode_ref(*args, window=6)
    got = paged_attention_decode_triton(*args, num_splits=2, min_split_len=4, window=6)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def extend_case(page: int, window: int) -> tuple:
    """(q, k_cache, v_cache, full tables, freed tables, seq_lens, qsl) of a windowed extend."""
    lens = [s + n for s, n in EXTEND_ROWS]
    k_cache, v_cache = make_pool(page, torch.float32, seed=window)
    full = tables_of(lens, page, seed=page)
    firsts = [max(0, s - window + 1) for s, _ in EXTEND_ROWS]
    counts = torch.tensor([n for _, n in EXTEND_ROWS])
    qsl = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    g = torch.Generator().manual_seed(page)
    q = torch.randn(int(counts.sum()), GROUP * NUM_KV, HEAD_DIM, generator=g)
    return q, k_cache, v_cache, full, freed(full, firsts, page), torch.tensor(lens), qsl


@pytest.mark.parametrize("page,window", WINDOWS)
def test_extend_ref_is_the_windowed_softmax(page: int, window: int) -> None:
    q, k_cache, v_cache, full, table, seq_lens, qsl = extend_case(page, window)
    got = paged_attention_extend_ref(
        q,
        k_cache,
        v_cache,
        table,
        seq_lens,
        qsl,
        HEAD_DIM**-0.5,
        page,
        max_query_len=21,
        window=window,
    )
    for b, (start, n) in enumerate(EXTEND_ROWS):
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        positions = list(range(start, start + n))
        want = oracle(q[lo:hi], k_cache, v_cache, full[b].tolist(), positions, page, window)
        torch.testing.assert_close(got[lo:hi], want, **TOL)


@pytest.mark.parametrize("page,window", WINDOWS)
def test_extend_kernel_matches_ref(page: int, window: int) -> None:
    q, k_cache, v_cache, _, table, seq_lens, qsl = extend_case(page, window)
    args = (q, k_cache, v_cache, table, seq_lens, qsl, HEAD_DIM**-0.5, page)
    want = paged_attention_extend_ref(*args, max_query_len=21, window=window)
    out = torch.full_like(q, float("nan"))
    paged_attention_extend_triton(*args, max_query_len=21, out=out, window=window)
    torch.testing.assert_close(out, want, **TOL)


# ---- the dispatch: StepTensors -> every backend, window 0 and windowed layers mixed ---------


def _step(rows: list[tuple[int, int]], page: int, window: int, seed: int) -> tuple:
    """(full step, windowed step): the windowed one's table has the pages wholly before each
    row's first window freed to page 0, as a sliding layer's block table has them."""
    rng = random.Random(seed)
    free = list(range(1, NUM_PAGES))
    rng.shuffle(free)
    seqs = []
    for i, (start, n) in enumerate(rows):
        need = -(-(start + n) // page)
        table, free = tuple(free[:need]), free[need:]
        toks = tuple(rng.randrange(5, 50) for _ in range(n))
        seqs.append(SeqChunk(f"r{i}", toks, start, 9 - i, table, None))
    step = StepInputs(page, torch.device("cpu")).build(StepPlan(1, tuple(seqs)))
    firsts = [max(0, start - window + 1) for start, _ in rows]
    return step, replace(step, block_tables=freed(step.block_tables, firsts, page))


@pytest.mark.parametrize(
    "rows",
    [
        [(5, 1), (17, 1), (2, 1), (30, 1)],  # decode
        [(0, 14), (19, 3), (4, 1), (0, 1), (25, 9)],  # prefill, resumed chunks, decode rows
    ],
    ids=["decode", "extend"],
)
@pytest.mark.parametrize("page,window", [(4, 6), (8, 8), (4, 100)])
def test_every_backend_mixes_full_and_windowed_layers(
    monkeypatch: pytest.MonkeyPatch, rows: list[tuple[int, int]], page: int, window: int
) -> None:
    """Full and sliding layers of one step alternate on one scratch (its per-step values must
    not leak between windows); every backend agrees with the oracles, and the sliding layers
    read no freed page (NaN)."""
    step, win_step = _step(rows, page, window, seed=page + window)
    k_nan, v_nan = make_pool(page, torch.float32, seed=window)
    k_ok, v_ok = k_nan.nan_to_num(0.5), v_nan.nan_to_num(0.5)  # full layers: a finite page 0
    q = torch.randn(step.num_tokens, GROUP * NUM_KV, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    qsl, tables = step.query_start_loc.tolist(), step.block_tables.tolist()
    assert step.seq_lens.tolist() == [s + n for s, n in rows]  # the plan's order
    want_win = torch.cat(
        [
            oracle(
                q[qsl[b] : qsl[b + 1]], k_nan, v_nan, tables[b], list(range(s, s + n)), page, window
            )
            for b, (s, n) in enumerate(rows)
        ]
    )
    want_full = paged_attention_ref(q, k_ok, v_ok, step, scale)
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SHORTCONV_KERNELS", backend)
        scratch = StepScratch() if backend == "torch" else None
        for _ in range(2):  # second round: the scratch's per-step values are reused
            full = paged_attention(q, k_ok, v_ok, step, scale, scratch)
            win = paged_attention(q, k_nan, v_nan, win_step, scale, scratch, window=window)
            torch.testing.assert_close(full, want_full, **TOL)
            torch.testing.assert_close(win, want_win, **TOL)
    ref = paged_attention_ref(q, k_nan, v_nan, win_step, scale, window=window)
    torch.testing.assert_close(ref, want_win, **TOL)
    cpu = paged_attention_cpu(q, k_nan, v_nan, win_step, scale, StepScratch(), window=window)
    torch.testing.assert_close(cpu, want_win, **TOL)


@pytest.mark.parametrize("window", [1, 6, 100])
def test_windowed_dense_layout_gathers_only_the_window(window: int) -> None:
    """The torch paths' windowed layout is at most window + Q - 1 columns wide and every column
    of a row reads a page of that row's window span (never a freed page)."""
    from shortconv.kernels.attention_dense import dense_indices

    page, rows = 4, [(0, 14), (19, 3), (4, 1), (25, 9)]
    step, win_step = _step(rows, page, window, seed=window)
    dense = dense_indices(win_step, window=window)
    max_q = max(n for _, n in rows)
    assert dense.kv_gather.shape[1] == min(step.max_seq_len, window + max_q - 1)
    tables = step.block_tables.tolist()
    for b, (start, n) in enumerate(rows):
        lo = max(0, start - window + 1)
        span = {tables[b][p // page] * page + p % page for p in range(lo, start + n)}
        assert set(dense.kv_gather[b].tolist()) <= span, b


def test_extend_tiles_let_every_windowed_row_see_its_first_key_block() -> None:
    """The windowed extend loop starts at its block's first query's window: a row BLOCK_M - 1
    later sees keys from BLOCK_M - 1 on, which the first BLOCK_N keys must include (else that
    row's softmax starts empty: NaN). Query rows per program never exceed keys per step."""
    from shortconv.kernels.launch_config import ATTN_EXTEND

    assert all(cfg.block_i <= cfg.block_n for cfg in ATTN_EXTEND.values())
