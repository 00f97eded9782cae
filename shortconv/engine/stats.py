"""A cheap snapshot of engine state for metrics, health and tests (read on the engine thread)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    """Occupancy and counters. Slot pools share slot ids, so every pool reports the same usage;
    `pools` lists the state kinds the model keeps ("conv", plus "prev_state" for ZAYA1)."""

    pools: tuple[str, ...]
    slots_used: int
    slots_total: int
    kv_pages_used: int
    kv_pages_total: int
    num_running: int
    num_waiting: int
    sessions_held: int
    session_hits: int
    session_misses: int
    session_evictions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    cached_tokens_total: int
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # Prefix cache (all 0 with it off): lookups and hits in prompt tokens, the checkpoints and
    # KV pages it holds (both counted in slots_used / kv_pages_used too), checkpoint memory
    # over the whole model (each TP rank holds its shard), entries evicted.
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_checkpoints: int = 0
    prefix_cache_checkpoint_bytes: int = 0
    prefix_cache_pages: int = 0
    prefix_cache_evictions: int = 0
    # KV pages per kind of attention layer group (`cache.kv_groups`): "full" is group 0 (the
    # pages `kv_pages_used` counts), "sliding" every sliding-window group summed (LFM3; 0 of 0
    # for models without one). Each group has its own pool, so each has its own total.
    kv_pages_used_by_kind: dict[str, int] = field(default_factory=dict)
    kv_pages_total_by_kind: dict[str, int] = field(default_factory=dict)
    # Vision models: images run through the encoder (again after a preemption), and its time
    # (rank 0's; the encoder is replicated on every TP rank).
    images_encoded_total: int = 0
    encoder_seconds_total: float = 0.0
    # Rank 0's weights by storage dtype ("int8" with `quantization="int8"`), fixed at start-up.
    weight_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (all 0 with it off): verify rows run, tokens they proposed, and the
    # proposals accepted (vLLM's spec_decode_num_drafts / _num_draft_tokens /
    # _num_accepted_tokens).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # The same three by proposal method (every method present, at 0 when unused); proposals
    # accepted by position ("0" = the first proposal; one key per position up to k); and
    # verify rows by accepted length (`[n]`: rows that kept exactly n proposals, n = 0..k).
    spec_decode_num_drafts_by_method: dict[str, int] = field(default_factory=dict)
    spec_decode_num_draft_tokens_by_method: dict[str, int] = field(default_factory=dict)
    spec_decode_num_accepted_tokens_by_method: dict[str, int] = field(default_factory=dict)
    spec_decode_num_accepted_tokens_per_pos: dict[str, int] = field(default_factory=dict)
    spec_decode_accepted_lengths: tuple[int, ...] = ()
    # Session state bundles (`engine.session_state`, docs/session_store.md): bundles and their
    # bytes by event (exported, imported, spilled, restored; every key present from the start)
    # and bundles refused by reason (metrics.defs.SESSION_STATE_REFUSALS).
    session_state_bundles: dict[str, int] = field(default_factory=dict)
    session_state_bytes: dict[str, int] = field(default_factory=dict)
    session_state_refused: dict[str, int] = field(default_factory=dict)
    # LoRA (`lora.counters`; all 0 and empty without enable_lora): adapters resident in slots
    # now, requests by adapter name ("" = the base), adapters loaded, unloaded and evicted
    # from their slot (LRU) since start-up, and loads refused by reason.
    lora_adapters_resident: int = 0
    lora_requests: dict[str, int] = field(default_factory=dict)
    lora_generation_tokens: dict[str, int] = field(default_factory=dict)
    lora_loads: int = 0
    lora_unloads: int = 0
    lora_evictions: int = 0
    lora_load_refusals: dict[str, int] = field(default_factory=dict)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0


@dataclass(frozen=True)
class GraphStats:
    """Counters since start-up (every key present from the start, at 0)."""

    num_graphs: int
    capture_seconds: float
    replays: int
    replay_failures: dict[str, int]  # by phase: prepare | replay
    eager_fallbacks: dict[str, int]  # by reason: no_bucket | mixed_width | replay_error
    verify_replays: int = 0  # of `replays`, those of verify steps (speculative decoding)


@dataclass(frozen=True)
class StartupReport:
    """One process's start: `before_s` (alive before its first phase: Ray's worker start and
    imports), each phase in order with its seconds, and the resident memory at the end."""

    who: str
    before_s: float
    phases: tuple[tuple[str, float], ...]
    rss_bytes: int

    @property
    def total_s(self) -> float:
        return self.before_s + sum(s for _, s in self.phases)

    def line(self) -> str:
        parts = " ".join(f"{name} {s:.2f}s" for name, s in self.phases)
        return (
            f"{self.who} start: process {self.before_s:.2f}s, {parts}; "
            f"total {self.total_s:.2f}s; RSS {self.rss_bytes / 2**20:.0f} MiB"
        )
