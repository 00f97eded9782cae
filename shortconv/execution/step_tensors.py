"""Turn a StepPlan into the step's index tensors (built on the host once, moved once)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from shortconv.engine.plan import SeqChunk, StepPlan

T = TypeVar("T")


class MissingDenseIndices(RuntimeError):
    """The torch attention path was handed a step built for the paged (Triton) kernels."""


@dataclass(frozen=True)
class DenseAttentionIndices:
    """The torch attention path's padded layout (B, Q, L as in `StepTensors`).

    kv_gather int64 [B, L] (flat KV row of each context position, scratch row 0 past the end;
    the dense form of block_tables); attn_mask bool [B, Q, L]; q_pad_index int64 [B*Q] into
    T+1 rows (row T is a zero row); q_unpad_index int64 [T] into B*Q.
    """

    kv_gather: torch.Tensor
    attn_mask: torch.Tensor
    q_pad_index: torch.Tensor
    q_unpad_index: torch.Tensor


@dataclass(frozen=True)
class StepTensors:
    """All per-step indices. B = sequences, T = new tokens, Q = longest chunk, L = longest context.

    input_ids/positions [T] int64; query_start_loc int32 [B+1]; cache_indices int64 [B] (state
    slots); has_initial_state bool [B]; seq_lens int64 [B] (context after this step);
    token_seq_index int64 [T]; slot_mapping int64 [T] (flat KV row of each new token);
    logits_indices int64 [S] (last token of sampled chunks); block_tables int32 [B, P] (the
    paged kernels' page table, P = ceil(L / page_size): each row's pages, scratch page 0 past
    them) with its `page_size`.

    `dense` holds the torch attention path's [B, L] gather and [B, Q, L] mask, or None for a
    step built for the paged (Triton) kernels, which read block_tables and seq_lens alone.
    Reading `kv_gather`, `attn_mask`, `q_pad_index` or `q_unpad_index` of such a step raises
    `MissingDenseIndices` instead of handing the torch path a missing tensor.
    """

    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    is_decode: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    cache_indices: torch.Tensor
    has_initial_state: torch.Tensor
    has_initial_state_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    token_seq_index: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    block_tables: torch.Tensor
    page_size: int
    dense: DenseAttentionIndices | None

    def dense_indices(self) -> DenseAttentionIndices:
        """The torch attention path's indices; raises when the step was built without them."""
        if self.dense is None:
            raise MissingDenseIndices(
                "this step was built for the paged (Triton) attention kernels and has no dense "
                "kv_gather / attn_mask; the torch attention path needs a step built with "
                "dense_attention=True (ShortConvBackend decides it once from the kernel "
                "backend: was SHORTCONV_KERNELS changed after the backend was built?)"
            )
        return self.dense

    @property
    def kv_gather(self) -> torch.Tensor:
        return self.dense_indices().kv_gather

    @property
    def attn_mask(self) -> torch.Tensor:
        return self.dense_indices().attn_mask

    @property
    def q_pad_index(self) -> torch.Tensor:
        return self.dense_indices().q_pad_index

    @property
    def q_unpad_index(self) -> torch.Tensor:
        return self.dense_indices().q_unpad_index


class StepScratch:
    """One backend's reusable work buffers and once-per-step derived tensors (CPU kernels).

    Why: the decode attention's gathered K/V are tens of MB per layer per step; glibc hands
    blocks above its mmap threshold (at most 32 MiB) back to the OS on free, so a fresh tensor
    page-faults all of it again every layer (measured: a 33 MB gather took 19 ms into a fresh
    tensor, 3.3 ms into a reused one). `per_step` values (e.g. head-major gather rows, the
    decode mask bias) are built by the first layer that asks and dropped by `new_step`.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._per_step: dict[object, Any] = {}
        self._constants: dict[object, torch.Tensor] = {}

    def new_step(self) -> None:
        self._per_step.clear()

    def buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat tensor of `numel` elements (like's dtype and device), reused across calls."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype:
            # Why the headroom: decode contexts grow by one token per step, so an exact-size
            # buffer was replaced (and page-faulted afresh) on every step; 1/4 more lasts a
            # 512-token context ~128 steps (measured: 30 ms of a 222 ms batch-32 step).
            size = numel + numel // 4
            buf = self._buffers[name] = torch.empty(size, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def constant(self, key: object, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A read-only tensor kept across steps (e.g. `arange(batch)`): one per key, and keys
        are bounded by the batch sizes a backend sees."""
        value = self._constants.get(key)
        if value is None:
            value = self._constants[key] = build()
        return value

    def per_step(self, key: object, build: Callable[[], T]) -> T:
        value = self._per_step.get(key)
        if value is None:
            value = self._per_step[key] = build()
        return value


def build_step_tensors(
    plan: StepPlan,
    page_size: int,
    device: torch.device,
    scratch: StepScratch | None = None,
    *,
    dense_attention: bool,
) -> StepTensors:
    """`scratch` (optional) keeps a decode step's batch-size-only tensors across steps.

    `dense_attention`: build the torch attention path's `DenseAttentionIndices` (the caller's
    once-made kernel choice, `kernels.dispatch.needs_dense_attention`); without them the step
    carries only what the paged Triton kernels read, so a long prefill builds no [B, Q, L] mask.
    """
    seqs = plan.seqs
    if not seqs:
        raise ValueError("empty step plan")
    if plan.is_decode:
        return _decode_step_tensors(seqs, page_size, device, scratch, dense_attention)
    return _general_step_tensors(seqs, page_size, device, dense_attention)


def _general_step_tensors(
    seqs: tuple[SeqChunk, ...], page_size: int, device: torch.device, dense_attention: bool
) -> StepTensors:
    """Any mix of prefill chunks and decode rows."""
    lens = torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64)
    starts = torch.tensor([s.start_pos for s in seqs], dtype=torch.int64)
    num_seqs, num_tokens = len(seqs), int(lens.sum())
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0).to(torch.int32)
    seq_lens = starts + lens
    max_q, max_l = int(lens.max()), int(seq_lens.max())

    input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)
    token_seq = torch.repeat_interleave(torch.arange(num_seqs), lens)
    token_off = torch.arange(num_tokens) - qsl[:-1].to(torch.int64)[token_seq]
    positions = starts[token_seq] + token_off

    max_pages = max(len(s.block_table) for s in seqs)
    tables = torch.zeros((num_seqs, max(max_pages, 1)), dtype=torch.int64)  # 0 = scratch page
    for b, s in enumerate(seqs):
        if s.block_table:
            tables[b, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int64)
    _check_tables(seqs, page_size)
    slot_mapping = tables[token_seq, positions // page_size] * page_size + positions % page_size

    # Only the pages the context covers: the decode kernel takes its split count from the width.
    block_tables = tables[:, : -(-max_l // page_size)].to(torch.int32)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    dense = None
    if dense_attention:
        host = _dense_general(tables, starts, lens, qsl, token_seq * max_q + token_off, page_size)
        dense = _moved(host, dev)

    sampled = [b for b, s in enumerate(seqs) if s.sampling is not None]
    logits_idx = (
        (qsl[1:].to(torch.int64) - 1)[sampled] if sampled else torch.zeros(0, dtype=torch.int64)
    )
    has_init = starts > 0
    slots = torch.tensor([s.slot for s in seqs], dtype=torch.int64)
    return StepTensors(
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        max_query_len=max_q,
        max_seq_len=max_l,
        is_decode=all(s.num_tokens == 1 and s.start_pos > 0 for s in seqs),
        input_ids=dev(input_ids),
        positions=dev(positions),
        query_start_loc=dev(qsl),
        query_start_loc_cpu=qsl,
        cache_indices=dev(slots),
        has_initial_state=dev(has_init),
        has_initial_state_cpu=has_init,
        seq_lens=dev(seq_lens),
        seq_lens_cpu=seq_lens,
        token_seq_index=dev(token_seq),
        slot_mapping=dev(slot_mapping),
        logits_indices=dev(logits_idx),
        block_tables=dev(block_tables),
        page_size=page_size,
        dense=dense,
    )


def _dense_general(
    tables: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    qsl: torch.Tensor,
    q_unpad: torch.Tensor,
    page_size: int,
) -> DenseAttentionIndices:
    """The padded [B, Q, L] layout of a general step, on the host (torch attention only)."""
    seq_lens = starts + lens
    max_q, max_l, num_tokens = int(lens.max()), int(seq_lens.max()), int(qsl[-1])
    ctx = torch.arange(max_l)
    kv_gather = tables[:, ctx // page_size] * page_size + ctx % page_size
    kv_gather = torch.where(ctx[None, :] < seq_lens[:, None], kv_gather, 0)
    qi = torch.arange(max_q)
    live_q = qi[None, :] < lens[:, None]  # [B, Q]
    q_pos = starts[:, None] + qi[None, :]
    mask = (ctx[None, None, :] <= q_pos[:, :, None]) & live_q[:, :, None]
    # NOTE: padded query rows attend to position 0 only, so softmax never sees an all-masked row.
    mask[:, :, 0] |= ~live_q
    q_pad = torch.where(live_q, qsl[:-1, None].to(torch.int64) + qi[None, :], num_tokens)
    return DenseAttentionIndices(kv_gather, mask, q_pad.reshape(-1), q_unpad)


def _moved(
    dense: DenseAttentionIndices, dev: Callable[[torch.Tensor], torch.Tensor]
) -> DenseAttentionIndices:
    return DenseAttentionIndices(
        dev(dense.kv_gather), dev(dense.attn_mask), dev(dense.q_pad_index), dev(dense.q_unpad_index)
    )


def _decode_step_tensors(
    seqs: tuple[SeqChunk, ...],
    page_size: int,
    device: torch.device,
    scratch: StepScratch | None,
    dense_attention: bool,
) -> StepTensors:
    """`build_step_tensors` for a decode plan (one token per sequence, every one resuming).

    Same tensors as the general path, built from host lists in about a third of the torch ops:
    at batch 1 on a small model the general path's ~40 tiny ops were a tenth of the step.
    """
    _check_tables(seqs, page_size)
    b = len(seqs)
    pos = [s.start_pos for s in seqs]
    max_l = max(pos) + 1
    n_pages = -(-max_l // page_size)
    # Token i is sequence i's only query: every per-token index below is the identity.
    host = torch.tensor(
        [
            [s.token_ids[0] for s in seqs],
            pos,
            [p + 1 for p in pos],
            [s.slot for s in seqs],
            [
                s.block_table[s.start_pos // page_size] * page_size + s.start_pos % page_size
                for s in seqs
            ],
        ],
        dtype=torch.int64,
    )
    input_ids, positions, seq_lens, slots, slot_mapping = host.unbind(0)
    tables = torch.tensor(
        [list(s.block_table[:n_pages]) + [0] * (n_pages - len(s.block_table)) for s in seqs],
        dtype=torch.int64,
    )
    sampled = [i for i, s in enumerate(seqs) if s.sampling is not None]

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t if device.type == "cpu" else t.to(device, non_blocking=True)

    def const(name: str, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        # Why: at batch 1 on a small model each tiny op is ~1% of the step; these depend on
        # the batch size alone, and nothing writes into a step's tensors.
        return build() if scratch is None else scratch.constant((name, b), build)

    has_init = const("ones", lambda: torch.ones(b, dtype=torch.bool))
    qsl = const("qsl", lambda: torch.arange(b + 1, dtype=torch.int32))
    rows_dev = const("rows", lambda: dev(torch.arange(b)))
    dense = None
    if dense_attention:
        gather, mask = _dense_decode(tables, positions, max_l, page_size, scratch)
        dense = DenseAttentionIndices(dev(gather), dev(mask), rows_dev, rows_dev)
    return StepTensors(
        num_seqs=b,
        num_tokens=b,
        max_query_len=1,
        max_seq_len=max_l,
        is_decode=True,
        input_ids=dev(input_ids),
        positions=dev(positions),
        query_start_loc=const("qsl_dev", lambda: dev(qsl)),
        query_start_loc_cpu=qsl,
        cache_indices=dev(slots),
        has_initial_state=const("ones_dev", lambda: dev(has_init)),
        has_initial_state_cpu=has_init,
        seq_lens=dev(seq_lens),
        seq_lens_cpu=seq_lens,
        token_seq_index=rows_dev,
        slot_mapping=dev(slot_mapping),
        logits_indices=(
            rows_dev if len(sampled) == b else dev(torch.tensor(sampled, dtype=torch.int64))
        ),
        block_tables=dev(tables.to(torch.int32)),
        page_size=page_size,
        dense=dense,
    )


def _dense_decode(
    tables: torch.Tensor,
    positions: torch.Tensor,
    max_l: int,
    page_size: int,
    scratch: StepScratch | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_gather [B, L], attn_mask [B, 1, L]) of a decode step, on the host."""
    b = tables.shape[0]
    live = torch.arange(max_l)[None, :] <= positions[:, None]  # [B, L]: position p sees 0..p
    in_page = (
        torch.arange(page_size)
        if scratch is None
        else scratch.constant(("in_page", page_size), lambda: torch.arange(page_size))
    )
    flat = tables[:, :, None] * page_size + in_page  # [B, pages, page]
    return torch.where(live, flat.view(b, -1)[:, :max_l], 0), live[:, None, :]


def _check_tables(seqs: tuple[SeqChunk, ...], page_size: int) -> None:
    """A short block table would silently send KV rows to the scratch page: refuse it."""
    for s in seqs:
        need = -(-(s.start_pos + s.num_tokens) // page_size)
        if len(s.block_table) < need:
            raise ValueError(
                f"request {s.request_id}: block table has {len(s.block_table)} pages, "
                f"needs {need} for {s.start_pos + s.num_tokens} positions"
            )
