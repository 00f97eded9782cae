"""Static decode buffers: the fixed-address step tensors a captured decode step reads.

A decode step of shape (batch bucket B, context bucket L) needs the same `StepTensors` fields
as an eager step, but at addresses that never change. They split in two:

* primary, built on the host from the plan: token ids, positions, slots, seq_lens, the
  per-shape constant index rows and the block tables, compact: `[B, w]` for the w pages the
  plan's longest context covers, after w itself. All of them are slices of ONE flat int64
  device buffer laid out per shape, so `refresh` is one host-to-device copy, and it zeroes and
  copies B * w table entries, not B * ceil(L / page): with one context bucket as wide as
  max_model_len (the Triton path) a short-context step stays as cheap as in a bucket its size.
* derived: slot_mapping, has_initial_state, query_start_loc, the int32 block_tables
  `[B, ceil(L / page)]` the paged kernels read (the compact table expanded, page 0 past w)
  and, for the torch attention path only (`dense_attention`), kv_gather `[B, L]` and
  attn_mask `[B, 1, L]`; computed on the device from the primary ones by `derive`. The graph
  runner calls `derive` INSIDE the captured region, so every replay rebuilds them from what
  `refresh` just wrote: no derived buffer can be left stale (or uninitialised) by a replay.

Without `dense_attention` (the Triton backend) no `[B, L]` buffer exists at all, and the
step's `dense` is None: the paged kernels mask each row by its seq_lens, so one context bucket
as wide as max_model_len costs a table `[B, ceil(L / page)]`, not a gather and mask `[B, L]`.

Padding contract (docs/architecture.md): rows past the plan's sequences are scratch rows: token 0,
position 0, slot 0, an all-zero block table (page 0). Their KV write and conv/prev state
update land in the scratch slot and page; they attend to position 0 only, so softmax never sees
an all-masked row. Context columns past a row's length gather page-0 row 0 and are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shortconv.engine.plan import StepPlan
from shortconv.execution.step_tensors import DenseAttentionIndices, StepTensors

# Per-row int64 fields of the primary block, in layout order (each B long); the dense ones
# follow only when the torch attention path is served.
_ROW_FIELDS = ("input_ids", "positions", "cache_indices", "seq_lens", "token_seq_index")
_DENSE_ROW_FIELDS = ("q_pad_index", "q_unpad_index")


@dataclass(frozen=True)
class DecodeShape:
    """One captured decode shape: `batch` rows (bucket) attending over `context` positions."""

    batch: int
    context: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class StaticDecodeBuffers:
    """Flat buffers sized for the largest (batch, context); each shape views fixed prefixes.

    `step(shape)` is the `StepTensors` whose tensors ARE the static buffers (bind it to the
    backend); `refresh(plan, shape)` writes the plan's primary metadata in place;
    `derive(shape)` recomputes the derived tensors in place on the device (capturable).
    """

    def __init__(
        self,
        max_batch: int,
        max_context: int,
        page_size: int,
        device: torch.device,
        *,
        dense_attention: bool,
    ) -> None:
        self.page_size = page_size
        self.device = device
        self.dense_attention = dense_attention
        self.row_fields = _ROW_FIELDS + (_DENSE_ROW_FIELDS if dense_attention else ())
        pages = _cdiv(max_context, page_size)
        n_primary = len(self.row_fields) * max_batch + 1 + max_batch * pages
        # Pinned staging makes the refresh copy asynchronous; its reuse waits on _copy_done.
        pin = device.type == "cuda"
        self.primary_host = torch.zeros(n_primary, dtype=torch.int64, pin_memory=pin)
        self.has_initial_state_host = torch.zeros(max_batch, dtype=torch.bool)
        self.qsl_host = torch.arange(max_batch + 1, dtype=torch.int32)
        self.primary = torch.zeros(n_primary, dtype=torch.int64, device=device)
        self.kv_gather: torch.Tensor | None = None
        self.attn_mask: torch.Tensor | None = None
        if dense_attention:
            n_dense = max_batch * max_context
            self.kv_gather = torch.zeros(n_dense, dtype=torch.int64, device=device)
            self.attn_mask = torch.zeros(n_dense, dtype=torch.bool, device=device)
        self.slot_mapping = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.has_initial_state = torch.zeros(max_batch, dtype=torch.bool, device=device)
        self.query_start_loc = torch.zeros(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch * pages, dtype=torch.int32, device=device)
        # NOTE: a capture-time constant (like the weights), not per-step metadata.
        arange_len = max(max_batch + 1, pages, max_context if dense_attention else 0)
        self._arange = torch.arange(arange_len, device=device)
        self._copy_done: torch.cuda.Event | None = None
        self._steps: dict[DecodeShape, StepTensors] = {}

    def _header(self, shape: DecodeShape) -> int:
        """Where the table width w sits in the shape's primary layout (the compact table next)."""
        return len(self.row_fields) * shape.batch

    def _rows(self, flat: torch.Tensor, shape: DecodeShape) -> dict[str, torch.Tensor]:
        b = shape.batch
        n = len(self.row_fields)
        return dict(zip(self.row_fields, flat[: n * b].view(n, b).unbind(0), strict=True))

    def step(self, shape: DecodeShape) -> StepTensors:
        """StepTensors over the static buffers; built once per shape, same objects ever after."""
        if shape in self._steps:
            return self._steps[shape]
        b = shape.batch
        pages = _cdiv(shape.context, self.page_size)
        r = self._rows(self.primary, shape)
        self._steps[shape] = st = StepTensors(
            num_seqs=b,
            num_tokens=b,
            max_query_len=1,
            max_seq_len=shape.context,
            is_decode=True,
            input_ids=r["input_ids"],
            positions=r["positions"],
            query_start_loc=self.query_start_loc[: b + 1],
            query_start_loc_cpu=self.qsl_host[: b + 1],
            cache_indices=r["cache_indices"],
            has_initial_state=self.has_initial_state[:b],
            has_initial_state_cpu=self.has_initial_state_host[:b],
            seq_lens=r["seq_lens"],
            seq_lens_cpu=self._rows(self.primary_host, shape)["seq_lens"],
            token_seq_index=r["token_seq_index"],
            slot_mapping=self.slot_mapping[:b],
            logits_indices=r["token_seq_index"],  # every row; the runner picks the live ones
            block_tables=self.block_tables[: b * pages].view(b, pages),
            page_size=self.page_size,
            dense=self._dense(shape, r) if self.dense_attention else None,
        )
        return st

    def _dense(self, shape: DecodeShape, rows: dict[str, torch.Tensor]) -> DenseAttentionIndices:
        b, n = shape.batch, shape.batch * shape.context
        assert self.kv_gather is not None and self.attn_mask is not None
        return DenseAttentionIndices(
            kv_gather=self.kv_gather[:n].view(b, shape.context),
            attn_mask=self.attn_mask[:n].view(b, 1, shape.context),
            q_pad_index=rows["q_pad_index"],
            q_unpad_index=rows["q_unpad_index"],
        )

    def refresh(self, plan: StepPlan | None, shape: DecodeShape) -> None:
        """Write the plan's primary metadata (None: all scratch rows) into the static buffers.

        Raises ValueError, before touching the device buffers, when the plan does not fit the
        shape or a block table is shorter than its sequence needs.
        """
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's copy may still read the staging
        seqs = plan.seqs if plan is not None else ()
        n, b, page = len(seqs), shape.batch, self.page_size
        if n > b or any(s.num_tokens != 1 or s.start_pos < 1 for s in seqs):
            raise ValueError(f"not a decode plan of at most {b} rows")
        for s in seqs:
            length = s.start_pos + 1
            if length > shape.context or _cdiv(length, page) > len(s.block_table):
                raise ValueError(
                    f"request {s.request_id}: context {length} does not fit the bucket "
                    f"({shape.context}) or its block table ({len(s.block_table)} pages)"
                )
        # The pages the longest context covers, as the eager decode builder lays them out.
        width = max((_cdiv(s.start_pos + 1, page) for s in seqs), default=0)
        head = self._header(shape)
        size = head + 1 + b * width
        self.primary_host[:size].zero_()
        r = self._rows(self.primary_host, shape)
        self.primary_host[head] = width
        tables = self.primary_host[head + 1 : size].view(b, width)
        for i, s in enumerate(seqs):
            used = s.block_table[:width]
            tables[i, : len(used)] = torch.tensor(used, dtype=torch.int64)
        if n:
            r["input_ids"][:n] = torch.tensor([s.token_ids[0] for s in seqs])
            r["positions"][:n] = torch.tensor([s.start_pos for s in seqs])
            r["cache_indices"][:n] = torch.tensor([s.slot for s in seqs])
        torch.add(r["positions"], 1, out=r["seq_lens"])
        for name in ("token_seq_index", *self.row_fields[len(_ROW_FIELDS) :]):
            r[name].copy_(self.qsl_host[:b])  # decode: row i is token i and query i
        self.has_initial_state_host[:b] = r["cache_indices"] != 0
        self.primary[:size].copy_(self.primary_host[:size], non_blocking=True)
        if self.device.type == "cuda":
            if self._copy_done is None:
                self._copy_done = torch.cuda.Event()
            self._copy_done.record()

    def derive(self, shape: DecodeShape) -> None:
        """Recompute the derived step tensors from the primary ones, on the device, in place.

        No host reads, fixed shapes: safe inside CUDA graph capture.
        """
        st, page, b = self.step(shape), self.page_size, shape.batch
        self._derive_tables(shape, st)
        if st.dense is not None:
            self._derive_dense(shape, st)
        page_of = st.block_tables.gather(1, (st.positions // page)[:, None])[:, 0]
        st.slot_mapping.copy_(page_of.to(torch.int64) * page + st.positions % page)
        st.has_initial_state.copy_(st.cache_indices != 0)  # NOTE: slot 0 is never live
        st.query_start_loc.copy_(self._arange[: b + 1])

    def _derive_tables(self, shape: DecodeShape, st: StepTensors) -> None:
        """Expand the compact `[B, w]` table into block_tables `[B, P]`, page 0 past w. w is
        read on the device (a 0-dim view), so the shapes stay fixed and no host sync happens."""
        b, pages, head = shape.batch, st.block_tables.shape[1], self._header(shape)
        # NOTE: refresh writes w <= P; the clamp keeps stray contents (never a plan's) in range.
        width = self.primary[head].clamp(0, pages)
        compact = self.primary[head + 1 : head + 1 + b * pages]
        cols = self._arange[:pages][None, :]
        inside = cols < width
        src = torch.where(inside, self._arange[:b, None] * width + cols, torch.zeros_like(cols))
        pages_of = torch.take(compact, src)
        # NOTE: int64 -> int32 on the copy: the paged kernels' page table.
        st.block_tables.copy_(torch.where(inside, pages_of, torch.zeros_like(pages_of)))

    def _derive_dense(self, shape: DecodeShape, st: StepTensors) -> None:
        """The torch attention path's kv_gather and attn_mask, in place (capturable)."""
        assert st.dense is not None
        page, ctx = self.page_size, self._arange[: shape.context]
        cols = (ctx // page).expand(shape.batch, -1)
        flat = st.block_tables.gather(1, cols).to(torch.int64) * page + ctx % page
        live = ctx[None, :] < st.seq_lens[:, None]
        st.dense.kv_gather.copy_(torch.where(live, flat, torch.zeros_like(flat)))
        st.dense.attn_mask.copy_((ctx[None, :] <= st.positions[:, None])[:, None, :])
