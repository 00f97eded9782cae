"""The engine's stats snapshot, read from its scheduler and cache manager (on the engine thread).

Kept out of `llm_engine` so the engine file stays about requests and steps; `EngineStats` itself
lives in `engine.stats`, which the Serve layer imports without the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shortconv.cache.manager import CacheManager
from shortconv.configs.speculative import METHODS
from shortconv.engine.scheduler import Scheduler
from shortconv.engine.stats import EngineStats
from shortconv.metrics.defs import SESSION_STATE_EVENTS, SESSION_STATE_REFUSALS

if TYPE_CHECKING:
    from shortconv.engine.session_state import StateCounters
    from shortconv.lora.engine_loras import EngineLoras


def engine_stats(
    scheduler: Scheduler,
    pools: tuple[str, ...],
    counts: Mapping[str, int],
    finished: Mapping[str, int],
    checkpoint_bytes: int,
    encoder_seconds: float = 0.0,
    weight_bytes: Mapping[str, int] | None = None,
    session_state: StateCounters | None = None,
    loras: EngineLoras | None = None,
) -> EngineStats:
    """Occupancy now, and the counters since start (`counts`: prompt/generation/cached tokens
    and images encoded; `finished`: requests by finish reason; `encoder_seconds`: the vision
    encoder's time); `checkpoint_bytes` is one checkpoint's size."""
    cm = scheduler.cache_manager
    return EngineStats(
        pools=pools,
        slots_used=cm.slots.num_used,
        slots_total=cm.slots.capacity,
        kv_pages_used=cm.pages.num_used,
        kv_pages_total=cm.pages.capacity,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        sessions_held=len(cm.sessions),
        session_hits=cm.sessions.hits,
        session_misses=cm.sessions.misses,
        session_evictions=cm.sessions.evictions,
        prompt_tokens_total=counts["prompt"],
        generation_tokens_total=counts["generation"],
        cached_tokens_total=counts["cached"],
        images_encoded_total=counts.get("images", 0),
        encoder_seconds_total=encoder_seconds,
        weight_bytes_by_dtype=dict(weight_bytes or {}),
        finished_by_reason=dict(finished),
        kv_pages_used_by_kind={
            "full": cm.pages.num_used,
            "sliding": sum(g.pages.num_used for g in cm.windows),
        },
        kv_pages_total_by_kind={
            "full": cm.pages.capacity,
            "sliding": sum(g.pages.capacity for g in cm.windows),
        },
        **_prefix_cache_stats(cm, checkpoint_bytes),
        **_spec_stats(scheduler),
        **_session_state_stats(session_state),
        **_lora_stats(loras),
    )


def _lora_stats(loras: EngineLoras | None) -> dict[str, Any]:
    if loras is None:
        return {}
    c = loras.counters
    return {
        "lora_adapters_resident": len(loras.slots.resident),
        "lora_requests": dict(c.requests),
        "lora_generation_tokens": dict(c.tokens),
        "lora_loads": c.loads,
        "lora_unloads": c.unloads,
        "lora_evictions": c.evictions,
        "lora_load_refusals": dict(c.refused),
    }


def _session_state_stats(c: StateCounters | None) -> dict[str, Any]:
    """Every event and reason at 0 from the start, so each series exists before it fires."""
    events = dict.fromkeys(SESSION_STATE_EVENTS, 0)
    refused = dict.fromkeys(SESSION_STATE_REFUSALS, 0)
    return {
        "session_state_bundles": events | dict(c.events if c else {}),
        "session_state_bytes": events | dict(c.bytes if c else {}),
        "session_state_refused": refused | dict(c.refused if c else {}),
    }


def _spec_stats(scheduler: Scheduler) -> dict[str, Any]:
    c, cfg = scheduler.speculator.counters, scheduler.speculator.cfg

    def by_method(value: int) -> dict[str, int]:
        return {m: value if cfg is not None and m == cfg.method else 0 for m in METHODS}

    return {
        "spec_decode_num_drafts": c.num_drafts,
        "spec_decode_num_draft_tokens": c.num_draft_tokens,
        "spec_decode_num_accepted_tokens": c.num_accepted_tokens,
        "spec_decode_num_drafts_by_method": by_method(c.num_drafts),
        "spec_decode_num_draft_tokens_by_method": by_method(c.num_draft_tokens),
        "spec_decode_num_accepted_tokens_by_method": by_method(c.num_accepted_tokens),
        "spec_decode_num_accepted_tokens_per_pos": {
            str(i): n for i, n in enumerate(c.accepted_per_pos)
        },
        "spec_decode_accepted_lengths": tuple(c.accepted_lengths),
    }


def _prefix_cache_stats(cm: CacheManager, checkpoint_bytes: int) -> dict[str, Any]:
    if not cm.prefix_caching:
        return {}
    cache, c = cm.tree, cm.tree.counters
    return {
        "prefix_cache_query_tokens": c.query_tokens,
        "prefix_cache_hit_tokens": c.hit_tokens,
        "prefix_cache_checkpoints": cache.num_checkpoints,
        "prefix_cache_checkpoint_bytes": cache.num_checkpoints * checkpoint_bytes,
        "prefix_cache_pages": cache.num_pages,
        "prefix_cache_evictions": c.evictions,
    }
