"""The per-step plan the scheduler sends to every TP rank (small, picklable, identical on all)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shortconv.engine.images import EncoderInput, ImageSlice
from shortconv.sampling.sampler import SamplingRow

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SeqChunk:
    """One request's share of a step: `token_ids` at positions start_pos..start_pos+len-1."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int  # tokens already folded into this slot's state (0: fresh state)
    slot: int
    block_table: tuple[int, ...]  # KV group 0's pages covering positions [0, start_pos + len)
    sampling: SamplingRow | None  # set when this chunk ends the prompt or is a decode step
    # Prefix-cache checkpoints inside the chunk: (tokens of this chunk folded in, 1..len-1;
    # destination slot). The chunk's end state is checkpointed by `copies_after` instead.
    checkpoints: tuple[tuple[int, int], ...] = ()
    # The sliding-window KV groups' tables (`cache.kv_groups` 1..), as long as `block_table`;
    # a page wholly before the window is scratch page 0.
    window_tables: tuple[tuple[int, ...], ...] = ()
    # Image embedding rows that replace this chunk's placeholder tokens' embeddings.
    images: tuple[ImageSlice, ...] = ()
    # A parent's last prompt chunk (`SamplingParams.n` > 1, `sampling` None): one (fork's
    # request id, its row) per fork, each drawing its first token from this chunk's last
    # position (one logits row, repeated per fork by the runner).
    fork_rows: tuple[tuple[str, SamplingRow], ...] = ()
    # A verify row (speculative decoding): the request's last token then k proposed ones; one
    # sampling row per position before the last (`sampling` is the last's), each drawn as if
    # the proposals before it had been accepted (engine.speculation).
    draft_rows: tuple[SamplingRow, ...] = ()
    # The draft model's distribution q [k, V] its sampled proposals came from (a request
    # with temperature > 0): the row is verified by rejection sampling against it. None:
    # one-hot proposals (n-gram, a greedy draft), verified by one draw per position.
    draft_probs: torch.Tensor | None = None
    # The LoRA adapter slot every token of this chunk uses (-1: the base model alone).
    lora_slot: int = -1

    @property
    def samples(self) -> tuple[tuple[str, SamplingRow], ...]:
        """(request id, row) of every token drawn from this chunk, in order: its last
        position's (a verify row: each of its last k + 1 positions'), or one per fork."""
        if self.sampling is not None:
            rows = (*self.draft_rows, self.sampling)
            return tuple((self.request_id, r) for r in rows)
        return self.fork_rows

    @property
    def num_draft(self) -> int:
        """Proposed tokens this verify row carries (0: not a verify row)."""
        return len(self.draft_rows)

    @property
    def num_logits(self) -> int:
        """Logits rows the chunk needs: its last k + 1 positions when sampled (k = 0 unless it
        verifies proposals; a forking parent's one row is repeated per fork after the head)."""
        return 1 + self.num_draft if self.is_sampled else 0

    @property
    def is_sampled(self) -> bool:
        """The chunk's last position needs a logits row (its own token, or its forks')."""
        return self.sampling is not None or bool(self.fork_rows)

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        """One block table per KV group."""
        return (self.block_table, *self.window_tables)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def has_initial_state(self) -> bool:
        return self.start_pos > 0


@dataclass(frozen=True)
class StepPlan:
    """Everything a rank needs for one forward, as (src, dst) id pairs around it:
    `copies_before` copies state slots (a request resuming from a prefix-cache checkpoint) and
    `page_copies` KV pages (copy on write of a cached, partly filled page; (group, src, dst),
    the group being the KV group of `cache.kv_groups`) before the forward;
    `copies_after` snapshots slots after it (a checkpoint at the end of a chunk). A resumed
    session is the same copy, with or without prefix caching.

    NOTE: each group is one gather then one scatter, so a slot or page freed and handed out
    again while this plan was scheduled is read before anything in the plan writes it."""

    step_id: int
    seqs: tuple[SeqChunk, ...]
    copies_after: tuple[tuple[int, int], ...] = ()
    copies_before: tuple[tuple[int, int], ...] = ()
    page_copies: tuple[tuple[int, int, int], ...] = ()
    # Images to encode before the forward, and encoder-cache entries to free after it.
    encoder_inputs: tuple[EncoderInput, ...] = ()
    encoder_frees: tuple[int, ...] = ()
    # Requests that left the running batch since the previous plan (finished, aborted,
    # preempted, a parent whose forks took over): ranks drop them from their persistent batch.
    released: tuple[str, ...] = ()

    @property
    def has_images(self) -> bool:
        """Some chunk's input is not token ids only (graphs never capture this)."""
        return bool(self.encoder_inputs) or any(s.images for s in self.seqs)

    def page_copies_by_group(self) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
        """`page_copies` as (group, its (src, dst) pairs), one entry per group that has any."""
        groups = sorted({g for g, _, _ in self.page_copies})
        return [(g, tuple((s, d) for gg, s, d in self.page_copies if gg == g)) for g in groups]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_decode(self) -> bool:
        """Every row is one token resuming kept state: the graph-capturable shape."""
        return all(s.num_tokens == 1 and s.start_pos > 0 for s in self.seqs)

    @property
    def is_verify(self) -> bool:
        """Some row verifies proposals and every row is a decode or verify row (its last token
        then its proposals, resuming kept state, its only checkpoints its spec slots): the
        shape the graph runner's verify ladder captures."""
        return any(s.num_draft for s in self.seqs) and all(
            s.start_pos > 0
            and s.sampling is not None
            and s.num_tokens == 1 + s.num_draft
            and len(s.checkpoints) == s.num_draft
            for s in self.seqs
        )


@dataclass(frozen=True)
class StepResult:
    """Rank 0's answer: the sampled tokens, one per (request id, row) of the chunks' `samples`,
    in plan order (a forking parent's chunk answers for each of its forks)."""

    step_id: int
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top_logprobs: tuple[list[tuple[int, float]] | None, ...]
    used_graph: bool = False
    encoder_seconds: float = 0.0  # the vision encoder's time in this step on rank 0
