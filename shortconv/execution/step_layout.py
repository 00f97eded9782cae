"""The layout of a step's primary block and its host values (`step_inputs.StepInputs` writes
them into one flat int64 staging block, then one copy to the device).

Fields, in order: input_ids, positions, token_seq_index, slot_mapping [T]; cache_indices,
seq_lens, has_initial_state [B]; query_start_loc [B+1]; logits_indices [S]; a captured verify
step's checkpoints [3N] (batch rows, lengths, slots; N = 0 elsewhere); the table width w;
the compact block table; then per sliding-window KV group its slot_mapping [T] and compact
table. A compact table is [B, w]; every table but the block's last is padded to its [B, P]
field, so the fields after it stay where the layout puts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from shortconv.cache.allocators import SCRATCH_PAGE, SCRATCH_SLOT
from shortconv.engine.plan import SeqChunk

FIELDS = (
    "ids",
    "pos",
    "tok",
    "kv",
    "slot",
    "len",
    "init",
    "qsl",
    "logits",
    "ck",
    "width",
    "tables",
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StepLayout:
    """A step's extents: T tokens, B rows, S sampled rows, P block-table columns, the number
    of KV groups (each past the first adds a slot mapping and a table) and N, the checkpoints
    a captured verify step carries in the block (an eager step packs its own: N = 0)."""

    tokens: int
    seqs: int
    sampled: int
    pages: int
    groups: int = 1
    checkpoints: int = 0

    def sizes(self) -> list[int]:
        t, b, n = self.tokens, self.seqs, self.checkpoints
        extra = [t, b * self.pages] * (self.groups - 1)
        return [t, t, t, t, b, b, b, b + 1, self.sampled, 3 * n, 1, b * self.pages, *extra]

    def fields(self) -> tuple[str, ...]:
        extra = (f"{name}{g}" for g in range(1, self.groups) for name in ("kv", "tables"))
        return (*FIELDS, *extra)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def host_values(
    seqs: tuple[SeqChunk, ...], layout: StepLayout, graph: bool, page: int
) -> list[int]:
    """The primary block's values in layout order, scratch rows past the plan (a bucket's
    rows all have its width: one token for decode, k + 1 for verify)."""
    pad = layout.seqs - len(seqs)
    width = layout.tokens // layout.seqs if graph else 1
    lens = [s.num_tokens for s in seqs] + [width] * pad
    starts = [s.start_pos for s in seqs] + [0] * pad
    qsl = list(accumulate(lens, initial=0))
    logits = (
        list(range(layout.seqs))  # a bucket: every row; the runner picks the live ones
        if graph
        else [
            qsl[b + 1] - s.num_logits + i for b, s in enumerate(seqs) for i in range(s.num_logits)
        ]
    )
    w = max((cdiv(s.start_pos + s.num_tokens, page) for s in seqs), default=0)
    # NOTE: a compact table fills only [B, w] of its [B, P] field; every field but the last is
    # written whole, so the fields after it stay where the layout puts them.
    tables = [_compact(seqs, g, w, layout) for g in range(layout.groups)]
    # NOTE: a scratch row writes its KV to row 0 of scratch page 0.
    kv = _kv_rows(seqs, 0, page) + [0] * (pad * width)
    windows = []
    for g in range(1, layout.groups):
        windows += [_kv_rows(seqs, g, page) + [0] * (pad * width), tables[g]]
    values = (
        [t for s in seqs for t in s.token_ids] + [0] * (pad * width),
        [p for st, n in zip(starts, lens, strict=True) for p in range(st, st + n)],
        [b for b, n in enumerate(lens) for _ in range(n)],
        kv,
        [s.slot for s in seqs] + [0] * pad,
        [st + n for st, n in zip(starts, lens, strict=True)],
        [int(st > 0) for st in starts],
        qsl,
        logits,
        _checkpoints(seqs, layout.checkpoints, layout.seqs - 1) if graph else [],
        [w],
        tables[0],
        *windows,
    )
    return [v for field in values for v in field]


def _checkpoints(seqs: tuple[SeqChunk, ...], n: int, scratch_row: int) -> list[int]:
    """A bucket's N checkpoints as rows, lengths, slots (an eager step packs its own); the
    unused ones write the state after one token of a scratch row into the scratch slot
    (harmless by contract)."""
    rows = [(b, j, slot) for b, s in enumerate(seqs) for j, slot in s.checkpoints]
    if len(rows) > n:
        raise ValueError(f"{len(rows)} state checkpoints, the bucket holds {n}")
    rows += [(scratch_row, 1, SCRATCH_SLOT)] * (n - len(rows))
    return [v for col in zip(*rows, strict=True) for v in col] if rows else []


def _compact(seqs: tuple[SeqChunk, ...], group: int, w: int, layout: StepLayout) -> list[int]:
    """One group's compact [B, w] table, scratch rows past the plan; every table but the
    block's last is padded to its whole [B, P] field."""
    values = [p for s in seqs for p in _row(s.tables[group], w)]
    size = layout.seqs * (w if group == layout.groups - 1 else layout.pages)
    return values + [0] * (size - len(values))


def _kv_rows(seqs: tuple[SeqChunk, ...], group: int, page: int) -> list[int]:
    """The flat KV row each new token writes in one KV group's pages."""
    rows = []
    for s in seqs:
        table = s.tables[group]
        rows += [table[p // page] * page + p % page for p in _positions(s)]
    return rows


def _positions(s: SeqChunk) -> range:
    return range(s.start_pos, s.start_pos + s.num_tokens)


def _row(table: tuple[int, ...], width: int) -> list[int]:
    used = list(table[:width])
    return used + [0] * (width - len(used))


def check_tables(seqs: tuple[SeqChunk, ...], page_size: int, groups: int) -> None:
    """A short block table, or a scratch page where a live row's chunk writes (a page freed
    behind a window, say), would silently send KV rows to the scratch page: refuse it, in every
    KV group. An explicit scratch row (slot 0) writes to page 0 by contract."""
    for s in seqs:
        need = cdiv(s.start_pos + s.num_tokens, page_size)
        if len(s.tables) != groups:
            raise ValueError(f"request {s.request_id}: {len(s.tables)} block tables, need {groups}")
        for g, table in enumerate(s.tables):
            if len(table) < need:
                raise ValueError(
                    f"request {s.request_id}: block table {g} has {len(table)} pages, "
                    f"needs {need} for {s.start_pos + s.num_tokens} positions"
                )
            if s.slot != SCRATCH_SLOT and SCRATCH_PAGE in table[s.start_pos // page_size : need]:
                raise ValueError(
                    f"request {s.request_id}: block table {g} has the scratch page where "
                    f"positions {s.start_pos}..{s.start_pos + s.num_tokens - 1} are written"
                )
