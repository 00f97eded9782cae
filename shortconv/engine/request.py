"""A request as the scheduler tracks it (mutable, owned by exactly one scheduler)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

from shortconv.cache.prefix_cache import CacheEntry
from shortconv.engine.images import PlacedImage, key_stream
from shortconv.engine.outputs import FinishReason
from shortconv.engine.spec_policy import AcceptanceTracker
from shortconv.sampling.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FORKING = "forking"  # an n > 1 request's prompt is computed; its forks copy its state
    FINISHED = "finished"


@dataclass(eq=False)  # NOTE: identity: a parent and its forks refer to each other
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    pages: list[int] = field(default_factory=list)  # KV group 0's (full attention)
    # One list per sliding-window KV group (LFM3), indexed like `pages`; scratch page 0 for the
    # pages freed behind the window.
    window_pages: list[list[int]] = field(default_factory=list)
    num_computed: int = 0  # tokens already folded into the slot's state and KV pages
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    session_id: str | None = None
    num_cached_tokens: int = 0  # prompt tokens resumed from kept state (session or prefix cache)
    looked_up: bool = False  # the checkpoint lookup is counted once, at the first admission
    # Checkpoint (position, slot) pairs the running step writes, inserted into the cache
    # manager's tree once it has run; and the end-of-prompt entry a session pins.
    pending_ckpts: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the slots a verify row writes the state after each of its first k
    # tokens into (cache.manager.CacheManager.spec_slots), and the tokens this request got in
    # the last step (a verify row may add several).
    spec_slots: list[int] = field(default_factory=list)
    num_new_tokens: int = 0
    spec_acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker)  # spec_policy
    prompt_entry: CacheEntry | None = None
    # Multimodal input: the prompt's images, and the encoder-cache key of each image index the
    # runner holds (engine.encoder_planner).
    images: tuple[PlacedImage, ...] = ()
    encoder_keys: dict[int, int] = field(default_factory=dict)
    # Forks (`SamplingParams.n` > 1). The parent computes the whole prompt and samples each
    # fork's first token from its last position, then holds that state (FORKING) until every
    # fork has copied it; each fork is a request of its own (`fork_id`, its own seed) that goes
    # on from there.
    index: int = 0  # this fork's choice index (0 for a request that is not a fork)
    parent: Request | None = None  # a fork: its parent request
    forks: list[Request] = field(default_factory=list)  # a parent: its forks, by index
    source: Request | None = None  # a fork not admitted yet: the parent whose state it copies
    # LoRA: the adapter's slot (-1: none) and its load's key (0: none), which every kept-state
    # key carries (`adapter_keys`), so no state is shared across adapters; its name labels the
    # request's generated tokens in the metrics.
    lora_slot: int = -1
    lora_key: int = 0
    lora_name: str | None = None

    @cached_property
    def prompt_key_ids(self) -> list[int]:
        """Kept state's key: the prompt with each image's placeholders as its digest
        (engine.images); built on first use, by the cache manager's lookups and checkpoints."""
        return adapter_keys(key_stream(self.prompt_token_ids, self.images), self.lora_key)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def all_key_ids(self) -> list[int]:
        """What prefix-cache checkpoints and session resumes are keyed by (`all_token_ids` with
        images as their digests)."""
        return self.prompt_key_ids + adapter_keys(self.output_token_ids, self.lora_key)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


# Key ids under an adapter are moved past every token id and image digest (64-bit).
_ADAPTER_KEY_SHIFT = 1 << 80


def adapter_keys(keys: list[int], lora_key: int) -> list[int]:
    """`keys` as kept state made under the adapter load `lora_key` is keyed (0: as is)."""
    if not lora_key:
        return keys
    offset = lora_key * _ADAPTER_KEY_SHIFT
    return [k + offset for k in keys]


def fork_id(request_id: str, index: int) -> str:
    """The scheduler's id of fork `index` of request `request_id` (its outputs carry the
    parent's id and `index`)."""
    return f"{request_id}/{index}"
