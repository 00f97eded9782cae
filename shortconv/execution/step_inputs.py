"""One builder of the step's inputs, for eager steps and captured decode graphs alike.

`StepInputs` owns persistent buffers and fills them in place. Every step goes the same way:

* `_write` (host): the plan's primary fields, padded with scratch rows up to the row count
  (a graph bucket's; an eager step has none), into ONE flat int64 staging block, then one copy
  to the device block. Layout (`step_layout.StepLayout`): input_ids, positions,
  token_seq_index, slot_mapping [T]; cache_indices, seq_lens, has_initial_state [B];
  query_start_loc [B+1]; logits_indices [S]; a verify bucket's checkpoints [3N]; the table
  width w; the compact block table [B, w]
  (only the pages the plan's longest context covers, so a wide bucket costs a short step
  nothing extra); then per sliding-window KV group (`cache.kv_groups` 1..) its slot_mapping
  [T] and compact table [B, w] (the same w).
* `derive` (device, no host reads, fixed shapes: capturable): block_tables int32 [B, P] of
  every KV group (the compact table expanded, page 0 past w), has_initial_state (bool),
  query_start_loc (int32).
  The graph runner calls it INSIDE the captured region, so no replay reads a stale (or
  uninitialised) derived buffer.

An eager step (`build`) takes views sized to itself; a graph bucket (`graph_step`, `refresh`,
`derive`) views the same buffers at the bucket's size, the same objects on every replay. A
verify bucket (width k + 1, speculative decoding) has B rows of exactly k + 1 tokens and its
N = B * k spec-slot checkpoints in the primary block, so their slot ids are static buffers
that every replay rewrites in place (`step_layout`).

Padding contract (docs/architecture.md): rows past the plan are scratch rows: token 0, position
0, slot 0, an all-zero block table (page 0); their KV write and state updates land in the
scratch slot and page, never in a live request's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.execution.state_checkpoints import build_state_checkpoints, build_verify_rows
from shortconv.execution.step_layout import StepLayout, cdiv, check_tables, host_values
from shortconv.execution.step_tensors import (
    StateCheckpoints,
    StepTensors,
    VerifyRows,
    WindowTables,
)

_Fields = dict[str, torch.Tensor]  # a step's primary fields, views of one flat block


@dataclass(frozen=True)
class DecodeShape:
    """One captured shape: `batch` rows (bucket) of `width` tokens each attending over
    `context` positions. Width 1 is a decode step; width k + 1 a verify step, whose rows
    each write k spec-slot checkpoints."""

    batch: int
    context: int
    width: int = 1

    @property
    def num_checkpoints(self) -> int:
        return self.batch * (self.width - 1)


class StepInputs:
    """The step's persistent input buffers on `device`, grown on demand until `freeze`."""

    def __init__(self, page_size: int, device: torch.device, num_kv_groups: int = 1) -> None:
        self.page_size, self.device, self.num_kv_groups = page_size, device, num_kv_groups
        self._cap = (0, 0, 0)  # tokens, seqs, pages
        self._frozen = False
        self._copy_done: torch.cuda.Event | None = None
        self._graph_steps: dict[DecodeShape, tuple[StepTensors, _Fields]] = {}
        self._alloc(1, 1, 1)

    # ---- capacity -----------------------------------------------------------------------
    def reserve(self, tokens: int, seqs: int, context: int) -> None:
        """Grow the buffers to hold steps of these extents. A graph runner calls it before it
        captures; growing invalidates graphs captured earlier over these buffers."""
        self._frozen = False
        self._fit(self._layout(tokens, seqs, 0, cdiv(context, self.page_size)), headroom=False)

    def freeze(self) -> None:
        """NOTE: captured graphs read these addresses; from now on a step that does not fit
        raises instead of reallocating under them."""
        self._frozen = True

    def _fit(self, layout: StepLayout, headroom: bool = True) -> None:
        want = (layout.tokens, layout.seqs, layout.pages)
        if all(w <= c for w, c in zip(want, self._cap, strict=True)):
            return
        if self._frozen:
            raise ValueError(f"step {layout} exceeds the captured step buffers {self._cap}")
        # Why the headroom: contexts grow a token per step; exact sizes would regrow often.
        grown = (w + w // 4 if headroom else w for w in want)
        self._alloc(*(max(c, g) for c, g in zip(self._cap, grown, strict=True)))

    def _alloc(self, tokens: int, seqs: int, pages: int) -> None:
        self._cap = (tokens, seqs, pages)
        dev, pin = self.device, self.device.type == "cuda"
        # NOTE: logits rows are at most one per token (a verify row has several), not per seq;
        # so are a verify bucket's checkpoints (k per k + 1 tokens).
        n = sum(self._layout(tokens, seqs, max(seqs, tokens), pages, tokens).sizes())
        # Pinned staging makes the copy asynchronous; its reuse waits on _copy_done.
        self.primary_host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.primary = (
            self.primary_host
            if dev.type == "cpu"
            else torch.zeros_like(self.primary_host, device=dev)
        )
        self.qsl_host = torch.zeros(seqs + 1, dtype=torch.int32)
        self.has_initial_state_host = torch.zeros(seqs, dtype=torch.bool)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=dev)
        self.has_initial_state = torch.zeros(seqs, dtype=torch.bool, device=dev)
        groups = self.num_kv_groups
        self.block_tables = torch.zeros(groups * seqs * pages, dtype=torch.int32, device=dev)
        # NOTE: a capture-time constant (like the weights), not per-step metadata.
        self._arange = torch.arange(max(seqs + 1, pages), device=dev)
        self._graph_steps.clear()

    # ---- eager steps ----------------------------------------------------------------------
    def build(self, plan: StepPlan) -> StepTensors:
        """The plan's step tensors: views of the buffers sized to the step."""
        seqs = plan.seqs
        if not seqs:
            raise ValueError("empty step plan")
        check_tables(seqs, self.page_size, self.num_kv_groups)
        max_l = max(s.start_pos + s.num_tokens for s in seqs)
        sampled = sum(s.num_logits for s in seqs)
        n_tokens = sum(s.num_tokens for s in seqs)
        layout = self._layout(n_tokens, len(seqs), sampled, cdiv(max_l, self.page_size))
        self._fit(layout)
        host = self._write(seqs, layout, graph=False)
        dev = host if self.primary is self.primary_host else self._split(self.primary, layout)
        step = self._view(
            layout,
            dev,
            host,
            max_query_len=max(s.num_tokens for s in seqs),
            max_seq_len=max_l,
            is_decode=plan.is_decode,
            checkpoints=build_state_checkpoints(plan, self.device),
            verify=build_verify_rows(plan, self.device),
        )
        self._derive(step, dev, known_width=True)
        return step

    # ---- graph buckets ----------------------------------------------------------------------
    def graph_step(self, shape: DecodeShape) -> StepTensors:
        """The bucket's step tensors over the buffers; the same objects on every replay."""
        return self._graph(shape)[0]

    def _graph(self, shape: DecodeShape) -> tuple[StepTensors, _Fields]:
        if shape not in self._graph_steps:
            layout = self._graph_layout(shape)
            self._fit(layout)
            dev, host = self._split(self.primary, layout), self._split(self.primary_host, layout)
            step = self._view(
                layout,
                dev,
                host,
                max_query_len=shape.width,
                max_seq_len=shape.context,
                is_decode=shape.width == 1,
                checkpoints=_static_checkpoints(dev["ck"], shape.num_checkpoints),
            )
            self._graph_steps[shape] = step, dev
        return self._graph_steps[shape]

    def refresh(self, plan: StepPlan | None, shape: DecodeShape) -> None:
        """Write a decode or verify plan (None: all scratch rows) into the bucket's primary
        fields.

        Raises ValueError, before touching any buffer, when the plan does not fit the bucket or
        a block table is shorter than its sequence needs.
        """
        seqs = plan.seqs if plan is not None else ()
        w = shape.width
        if len(seqs) > shape.batch or any(
            s.num_tokens != w or s.start_pos < 1 or len(s.checkpoints) != w - 1 for s in seqs
        ):
            raise ValueError(f"not a plan of at most {shape.batch} rows of width {w}")
        check_tables(seqs, self.page_size, self.num_kv_groups)
        for s in seqs:
            if s.start_pos + w > shape.context:
                raise ValueError(
                    f"request {s.request_id}: context {s.start_pos + w} does not fit the "
                    f"bucket ({shape.context})"
                )
        self.graph_step(shape)
        self._write(seqs, self._graph_layout(shape), graph=True)

    def derive(self, shape: DecodeShape) -> None:
        """The bucket's derived tensors from what `refresh` wrote (capturable)."""
        step, dev = self._graph(shape)
        self._derive(step, dev, known_width=False)

    def _graph_layout(self, shape: DecodeShape) -> StepLayout:
        b, t = shape.batch, shape.batch * shape.width
        pages = cdiv(shape.context, self.page_size)
        return self._layout(t, b, b, pages, shape.num_checkpoints)

    def _layout(
        self, tokens: int, seqs: int, sampled: int, pages: int, checkpoints: int = 0
    ) -> StepLayout:
        return StepLayout(tokens, seqs, sampled, pages, self.num_kv_groups, checkpoints)

    # ---- the one code path ----------------------------------------------------------------
    def _write(self, seqs: tuple[SeqChunk, ...], layout: StepLayout, graph: bool) -> _Fields:
        """Host values of the primary fields (scratch rows past the plan), one device copy;
        returns the host fields."""
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's copy may still read the staging
        flat = host_values(seqs, layout, graph, self.page_size)
        n = len(flat)
        self.primary_host[:n].copy_(torch.tensor(flat, dtype=torch.int64))
        host = self._split(self.primary_host, layout)
        self.qsl_host[: layout.seqs + 1].copy_(host["qsl"])
        self.has_initial_state_host[: layout.seqs].copy_(host["init"])
        if self.primary is not self.primary_host:
            self.primary[:n].copy_(self.primary_host[:n], non_blocking=True)
            if self._copy_done is None:
                self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        return host

    def _split(self, flat: torch.Tensor, layout: StepLayout) -> _Fields:
        sizes = layout.sizes()
        return dict(zip(layout.fields(), flat[: sum(sizes)].split(sizes), strict=True))

    def _view(
        self,
        layout: StepLayout,
        f: _Fields,
        host: _Fields,
        *,
        max_query_len: int,
        max_seq_len: int,
        is_decode: bool,
        checkpoints: StateCheckpoints | None = None,
        verify: VerifyRows | None = None,
    ) -> StepTensors:
        t, b, p = layout.tokens, layout.seqs, layout.pages
        tables = [
            self.block_tables[g * b * p : (g + 1) * b * p].view(b, p) for g in range(layout.groups)
        ]
        windows = tuple(WindowTables(f[f"kv{g}"], tables[g]) for g in range(1, layout.groups))
        return StepTensors(
            num_seqs=b,
            num_tokens=t,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            is_decode=is_decode,
            input_ids=f["ids"],
            positions=f["pos"],
            query_start_loc=self.query_start_loc[: b + 1],
            query_start_loc_cpu=self.qsl_host[: b + 1],
            cache_indices=f["slot"],
            has_initial_state=self.has_initial_state[:b],
            has_initial_state_cpu=self.has_initial_state_host[:b],
            seq_lens=f["len"],
            seq_lens_cpu=host["len"],
            token_seq_index=f["tok"],
            slot_mapping=f["kv"],
            logits_indices=f["logits"],
            block_tables=tables[0],
            page_size=self.page_size,
            checkpoints=checkpoints,
            windows=windows,
            verify=verify,
        )

    def _derive(self, step: StepTensors, f: _Fields, known_width: bool) -> None:
        """Derived tensors from the primary ones, on the device, in place (capturable).

        `known_width`: an eager step's table is exactly [B, w] (P = w), so it is copied as is;
        a bucket's w is read on the device and the table expanded to [B, P]."""
        b, p = step.block_tables.shape
        dests = [step.block_tables, *(w.block_tables for w in step.windows)]
        for g, dest in enumerate(dests):
            compact = f["tables" if g == 0 else f"tables{g}"]
            if known_width:
                dest.copy_(compact.view(b, p))  # NOTE: int64 -> int32 on the copy
            else:
                self._expand_tables(dest, compact, f["width"])
        step.has_initial_state.copy_(f["init"] != 0)
        step.query_start_loc.copy_(f["qsl"])

    def _expand_tables(self, dest: torch.Tensor, compact: torch.Tensor, w: torch.Tensor) -> None:
        """A compact [B, w] table into a block table `dest` [B, P], page 0 past w. w is read on
        the device (a 0-dim view): fixed shapes, no host sync."""
        b, p = dest.shape
        # NOTE: _write puts w <= P; the clamp keeps stray contents (never a plan's) in range.
        width = w[0].clamp(0, p)
        cols = self._arange[:p][None, :]
        inside = cols < width
        src = torch.where(inside, self._arange[:b, None] * width + cols, torch.zeros_like(cols))
        pages_of = torch.take(compact, src)
        # NOTE: int64 -> int32 on the copy: the paged kernels' page table.
        dest.copy_(torch.where(inside, pages_of, torch.zeros_like(pages_of)))


def _static_checkpoints(flat: torch.Tensor, n: int) -> StateCheckpoints | None:
    """A verify bucket's checkpoint rows, lengths and slots: views of its primary block."""
    if n == 0:
        return None
    seq, length, slot = flat.split(n)
    return StateCheckpoints(seq, length, slot)
