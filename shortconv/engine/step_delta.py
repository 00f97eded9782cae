"""The step message: what changed since the previous step, for a rank's persistent batch.

A `StepDelta` is the compact form of a `StepPlan` relative to what every rank already holds
(`execution.persistent_batch.PersistentBatch`): new requests once, then per row only its new
token ids, its start position, and edits to its slot, block tables and sampling history.

Every integer travels in one fixed-width int64 stream, so the pickled size of a decode step
depends on the number of rows, never on context length, step count or id magnitudes. Anything
that is not an integer (a new request's id, sampling params, grammar masks, images) rides in
`objects`, in the order the stream names it.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class RowFlag:
    """Which optional parts follow a row's start position and tokens in the stream (plain
    ints, not enum.IntFlag: they are or-ed and tested per row per step)."""

    SLOT = 1  # the slot changed (admission, preemption, a verify row's rollback swap)
    TABLES = 2  # some block table changed (pages appended, released behind a window, cut)
    SAMPLING = 4  # the row samples its own token(s)
    IMAGES = 8  # image slices for this chunk (one object)
    LORA = 16  # the row's LoRA adapter slot changed (a request's first row with an adapter)
    DRAFT_PROBS = 32  # a verify row's draft distribution q (one object: a [k, V] tensor)


class SampleFlag:
    """Which optional parts a sampling row carries."""

    PARAMS = 1  # new SamplingParams (one object)
    SEED = 2  # the seed changed
    MASK = 4  # a grammar token mask (one object)


@dataclass(frozen=True)
class StepDelta:
    """One step's message to every rank: `ints` is the int64 stream (layout in
    `engine.delta_encoder`), `new_ids` the request ids of handles first named this step,
    `objects` the non-integer payload in stream order."""

    ints: bytes
    new_ids: tuple[str, ...] = ()
    objects: tuple[Any, ...] = ()

    @property
    def step_id(self) -> int:
        return int.from_bytes(self.ints[:8], "little", signed=True)


class IntWriter:
    """Appends to the int64 stream."""

    def __init__(self) -> None:
        self.values = array("q")

    def put(self, *values: int) -> None:
        self.values.extend(values)

    def put_seq(self, values: Sequence[int]) -> None:
        """A length, then the values."""
        self.values.append(len(values))
        self.values.extend(values)

    def tobytes(self) -> bytes:
        # NOTE: little-endian on the wire whatever the host, so `step_id` reads it back.
        out = array("q", self.values)
        if sys.byteorder != "little":
            out.byteswap()
        return out.tobytes()


class IntReader:
    """Reads the int64 stream back, in order."""

    def __init__(self, data: bytes) -> None:
        values = array("q")
        values.frombytes(data)
        if sys.byteorder != "little":
            values.byteswap()
        self.values, self.at = values, 0

    def get(self) -> int:
        self.at += 1
        return self.values[self.at - 1]

    def get_seq(self) -> tuple[int, ...]:
        n = self.get()
        self.at += n
        return tuple(self.values[self.at - n : self.at])

    def done(self) -> bool:
        return self.at == len(self.values)


def tuple_edit(old: tuple[int, ...], new: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
    """(zeros, keep, tail) with new == (0,) * zeros + old[zeros:keep] + tail: appended pages
    and tokens are a tail, pages released behind a sliding window are leading zeros (scratch
    page 0), a cut (rejected proposals, rollback) is a shorter keep."""
    zeros = 0
    while zeros < len(new) and new[zeros] == 0:
        zeros += 1
    n = min(len(old), len(new))
    if zeros <= n and new[zeros:n] == old[zeros:n]:  # the common case, compared in C
        keep = n
    else:
        keep = zeros
        while keep < n and new[keep] == old[keep]:
            keep += 1
    return zeros, keep, new[keep:]


def apply_edit(
    old: tuple[int, ...], zeros: int, keep: int, tail: tuple[int, ...]
) -> tuple[int, ...]:
    """The inverse of `tuple_edit`."""
    return (0,) * zeros + old[zeros:keep] + tail
