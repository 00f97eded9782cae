"""The per-step plan the scheduler sends to every TP rank (small, picklable, identical on all)."""

from __future__ import annotations

from dataclasses import dataclass

from shortconv.sampling.sampler import SamplingRow


@dataclass(frozen=True)
class SeqChunk:
    """One request's share of a step: `token_ids` at positions start_pos..start_pos+len-1."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int  # tokens already folded into this slot's state (0: fresh state)
    slot: int
    block_table: tuple[int, ...]  # KV pages covering positions [0, start_pos + len)
    sampling: SamplingRow | None  # set when this chunk ends the prompt or is a decode step
    # Prefix-cache checkpoints inside the chunk: (tokens of this chunk folded in, 1..len-1;
    # destination slot). The chunk's end state is checkpointed by `copies_after` instead.
    checkpoints: tuple[tuple[int, int], ...] = ()

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
    `page_copies` KV pages (copy on write of a cached, partly filled page) before the forward;
    `copies_after` snapshots slots after it (a checkpoint at the end of a chunk). A resumed
    session is the same copy, with or without prefix caching.

    NOTE: each group is one gather then one scatter, so a slot or page freed and handed out
    again while this plan was scheduled is read before anything in the plan writes it."""

    step_id: int
    seqs: tuple[SeqChunk, ...]
    copies_after: tuple[tuple[int, int], ...] = ()
    copies_before: tuple[tuple[int, int], ...] = ()
    page_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_decode(self) -> bool:
        """Every row is one token resuming kept state: the graph-capturable shape."""
        return all(s.num_tokens == 1 and s.start_pos > 0 for s in self.seqs)


@dataclass(frozen=True)
class StepResult:
    """Rank 0's answer: sampled tokens for the chunks that asked for sampling, in plan order."""

    step_id: int
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top_logprobs: tuple[list[tuple[int, float]] | None, ...]
    used_graph: bool = False
