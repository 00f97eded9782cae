"""The step's index tensors: what every layer reads.

Built by `step_inputs.StepInputs`, for eager steps and captured graphs alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateCheckpoints:
    """int64 [N] each: the checkpoint's batch row, tokens of its chunk folded in, dest slot."""

    seq: torch.Tensor
    length: torch.Tensor
    slot: torch.Tensor


@dataclass(frozen=True)
class VerifyRows:
    """A verify-shaped step, resolved once per step so no layer re-derives it: every row
    resumes its state with exactly `width` tokens (its last token and k = width - 1
    proposals) and its checkpoints are its k spec slots at lengths 1..k, in order.
    `state_slots` int64 [B * width]: per row its spec slots then its live slot, i.e. where the
    state after each of its positions 1..width goes (one scatter a layer writes them all)."""

    width: int
    state_slots: torch.Tensor


@dataclass(frozen=True)
class WindowTables:
    """A sliding-window KV group's own indices: slot_mapping int64 [T] into the group's pages
    and block_tables int32 [B, P] (scratch page 0 for pages behind every window)."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor


@dataclass(frozen=True)
class StepTensors:
    """All per-step indices. B = sequences, T = new tokens, L = longest context.

    input_ids/positions [T] int64; query_start_loc int32 [B+1]; cache_indices int64 [B] (state
    slots); has_initial_state bool [B]; seq_lens int64 [B] (context after this step);
    token_seq_index int64 [T]; slot_mapping int64 [T] (flat KV row of each new token);
    logits_indices int64 [S] (last token of sampled chunks, once per chunk: the runner
    repeats a forking parent's logits row per fork; a verify row's last k + 1 tokens);
    block_tables int32 [B, P] (each row's pages, scratch page 0 past them,
    P = ceil(L / page_size)) with its `page_size`.
    The `*_cpu` tensors are host mirrors (extend steps read them). `checkpoints`: the step's
    prefix-cache checkpoints inside chunks (None on most steps, always in a captured graph).
    `slot_mapping` and `block_tables` are KV group 0's; `windows` holds the sliding-window
    groups' (`cache.kv_groups` 1..), which the backend swaps in for those groups' layers.
    `verify`: an eager verify-shaped step's rows (`VerifyRows`); None on any other step.

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
    windows: tuple[WindowTables, ...] = ()
    verify: VerifyRows | None = None
