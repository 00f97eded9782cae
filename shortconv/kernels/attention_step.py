"""What the attention entry points read of a step: a structural type, so kernels name no
engine module (the engine's `StepTensors` has these fields and more)."""

from __future__ import annotations

from typing import Protocol

import torch


class PagedAttentionStep(Protocol):
    """B = sequences, T = new tokens, L = longest context this step.

    block_tables int32 [B, P] (scratch page 0 past a row's pages) with `page_size`; seq_lens
    int64 [B] (context after this step); query_start_loc int32 [B+1]; positions and
    token_seq_index int64 [T]; the `*_cpu` tensors are host mirrors."""

    @property
    def num_seqs(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def max_query_len(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def block_tables(self) -> torch.Tensor: ...
    @property
    def seq_lens(self) -> torch.Tensor: ...
    @property
    def seq_lens_cpu(self) -> torch.Tensor: ...
    @property
    def query_start_loc(self) -> torch.Tensor: ...
    @property
    def query_start_loc_cpu(self) -> torch.Tensor: ...
    @property
    def positions(self) -> torch.Tensor: ...
    @property
    def token_seq_index(self) -> torch.Tensor: ...
