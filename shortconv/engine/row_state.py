"""What the driver and every rank both remember of one request between steps.

NOTE: mutable by design (the one exception to frozen dataclasses in the engine): the delta
encoder's mirror and each rank's persistent batch update these in place every step, by the
same rules, so the two stay equal and a step message need only carry the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shortconv.sampling.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRef:
    """The last sampling row sent for a request: its next row is sent as edits to this."""

    params: SamplingParams | None = None
    seed: int = 0
    prompt: tuple[int, ...] = ()  # penalty history: sent once
    output: tuple[int, ...] = ()  # penalty history: only the new tokens each step


@dataclass(slots=True)
class RowState:
    """One request's slot, block tables (one per KV group) and LoRA adapter slot (-1: none)
    as of its latest chunk."""

    handle: int  # the request's number in step messages (never reused)
    request_id: str
    slot: int = -1
    tables: tuple[tuple[int, ...], ...] = ()
    lora_slot: int = -1
    sample: SampleRef = field(default_factory=SampleRef)
