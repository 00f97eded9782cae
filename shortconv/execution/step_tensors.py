"""The step's index tensors (what every layer reads) and the CPU kernels' reusable buffers.

Built by `step_inputs.StepInputs`, for eager steps and captured graphs alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class StateCheckpoints:
    """int64 [N] each: the checkpoint's batch row, tokens of its chunk folded in, dest slot."""

    seq: torch.Tensor
    length: torch.Tensor
    slot: torch.Tensor


@dataclass(frozen=True)
class StepTensors:
    """All per-step indices. B = sequences, T = new tokens, L = longest context.

    input_ids/positions [T] int64; query_start_loc int32 [B+1]; cache_indices int64 [B] (state
    slots); has_initial_state bool [B]; seq_lens int64 [B] (context after this step);
    token_seq_index int64 [T]; slot_mapping int64 [T] (flat KV row of each new token);
    logits_indices int64 [S] (last token of sampled chunks); block_tables int32 [B, P] (each
    row's pages, scratch page 0 past them, P = ceil(L / page_size)) with its `page_size`.
    The `*_cpu` tensors are host mirrors (extend steps read them). `checkpoints`: the step's
    prefix-cache checkpoints inside chunks (None on most steps, always in a captured graph).

    Every attention path reads the context through block_tables and seq_lens; the torch path
    derives its dense gather and mask from them (`kernels.attention_dense`).
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
    checkpoints: StateCheckpoints | None = None


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
