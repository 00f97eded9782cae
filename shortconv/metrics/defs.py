"""Metric definitions: names, kinds, label values, histogram ladders and where each gauge or
counter reads its value (an EngineStats or GraphStats attribute). No torch, no engine import:
the recorder (shortconv.metrics.recorder), Ray's sink and the docs all read this one table.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from shortconv.configs.speculative import METHODS
from shortconv.engine.outputs import FinishReason
from shortconv.metrics.buckets import (
    ACCEPTED_LENGTH_BUCKETS,
    E2E_BUCKETS,
    ITL_BUCKETS,
    STEP_BUCKETS,
    TTFT_BUCKETS,
)
from shortconv.metrics.lora_metrics import LORA_LOAD_REFUSALS, LORA_METRICS
from shortconv.metrics.metric_def import Kind, Labels, MetricDef, metric

if TYPE_CHECKING:
    from shortconv.engine.stats import EngineStats, GraphStats

# Label values that exist from start-up. The graph reasons mirror graph_runner.FAILURE_PHASES
# and FALLBACK_REASONS (a test keeps them equal; importing them here would pull in torch).
REPLAY_FAILURE_REASONS = ("prepare", "replay")
FALLBACK_REASONS = ("no_bucket", "mixed_width", "replay_error")
FINISHED_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.ERROR)
STEP_PHASES = ("decode", "extend", "mixed")
KV_GROUP_KINDS = ("full", "sliding")  # EngineStats.kv_pages_*_by_kind's keys
# weight_bytes_by_dtype's keys ("int6": q6, int4's LM head and some ffn_down layers)
WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4", "int6")
# What happens to a session state bundle, and why one is refused: the bundle's own checks
# (truncated, checksum, version, format), a layout that is not this engine's (fingerprint,
# dtype, tp_size, page_size), tensors that do not fit (shape), no free slot or pages (no_room),
# an executor that cannot move state (tp), a TP rank that died or failed while state moved
# (executor), a session store that could not save a spill (store). `engine.session_state`
# counts only these.
SESSION_STATE_EVENTS = ("exported", "imported", "spilled", "restored")
SESSION_STATE_REFUSALS = (
    "truncated",
    "checksum",
    "version",
    "format",
    "fingerprint",
    "dtype",
    "tp_size",
    "page_size",
    "shape",
    "no_room",
    "tp",
    "executor",
    "store",
)
_LABEL_VALUES = {
    "finished_reason": FINISHED_REASONS,
    "phase": STEP_PHASES,
    "kind": KV_GROUP_KINDS,
    "dtype": WEIGHT_DTYPES,
    "method": METHODS,
    "event": SESSION_STATE_EVENTS,
}


def _m(kind: Kind, name: str, source: str, help: str, label: str = "", **kw: Any) -> MetricDef:
    values = kw.pop("values", _LABEL_VALUES.get(label, ()))
    return metric(kind, name, source, help, label, values=values, **kw)


METRICS: tuple[MetricDef, ...] = (
    _m(
        "gauge",
        "state_slots_used",
        "engine.slots_used",
        "State-pool slots in use (running "
        "requests, prefix-cache and session checkpoints); pools share slot ids and counts.",
        "pool",
    ),
    _m(
        "gauge",
        "state_slots_total",
        "engine.slots_total",
        "State-pool slots requests can use (the scratch slot excluded).",
        "pool",
    ),
    _m(
        "gauge",
        "kv_cache_usage_perc",
        "engine.kv_cache_usage",
        "Fraction of attention KV-cache pages in use (1 = full).",
    ),
    _m(
        "gauge",
        "kv_pages_used",
        "engine.kv_pages_used_by_kind",
        "KV pages in use, by kind of attention layer: full (every position kept) or sliding "
        "(sliding-window layers, pages behind the window freed; LFM3).",
        "kind",
    ),
    _m(
        "gauge",
        "kv_pages_capacity",
        "engine.kv_pages_total_by_kind",
        "KV pages in each kind's pool (sliding: 0 for models without sliding-window layers).",
        "kind",
    ),
    _m(
        "gauge",
        "weight_bytes",
        "engine.weight_bytes_by_dtype",
        "Weight bytes of TP rank 0 (the replica with tp_size 1) by storage dtype, from start-up "
        "(int8 with quantization int8: the weights and their scales; int4 with int4: the codes, "
        "scales and mins; int6 with int4: the q6 LM head's and ffn_down layers' codes and "
        "scales).",
        "dtype",
    ),
    _m(
        "counter",
        "graph_replays_total",
        "graphs.replays",
        "Decode steps run as a replay of a captured graph.",
    ),
    _m(
        "counter",
        "graph_replay_failures_total",
        "graphs.replay_failures",
        "Failed graph "
        "replays (state restored), by phase: prepare (metadata refresh) or replay (the forward).",
        "reason",
        values=REPLAY_FAILURE_REASONS,
    ),
    _m(
        "counter",
        "graph_eager_fallbacks_total",
        "graphs.eager_fallbacks",
        "Decode and verify steps run eagerly: no_bucket (beyond the largest bucket), "
        "mixed_width (verify rows of different widths, or beside decode rows) or replay_error "
        "(after a failed replay).",
        "reason",
        values=FALLBACK_REASONS,
    ),
    _m(
        "counter",
        "session_cache_hits_total",
        "engine.session_hits",
        "Session turns resumed from kept state.",
    ),
    _m(
        "counter",
        "session_cache_misses_total",
        "engine.session_misses",
        "Session turns that found no reusable kept state.",
    ),
    _m(
        "counter",
        "session_cache_evictions_total",
        "engine.session_evictions",
        "Kept session checkpoints evicted (TTL or pressure).",
    ),
    _m(
        "gauge",
        "sessions_held",
        "engine.sessions_held",
        "Sessions whose state is kept on this engine.",
    ),
    _m(
        "counter",
        "prefix_cached_tokens_total",
        "engine.cached_tokens_total",
        "Prompt tokens resumed from kept state (prefix cache or session) instead of prefilled.",
    ),
    _m(
        "counter",
        "prefix_cache_queries_total",
        "engine.prefix_cache_query_tokens",
        "Prompt tokens of admitted requests looked up in the prefix cache.",
    ),
    _m(
        "counter",
        "prefix_cache_hits_total",
        "engine.prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache (resumed instead of prefilled).",
    ),
    _m(
        "counter",
        "prefix_cache_evictions_total",
        "engine.prefix_cache_evictions",
        "Prefix-cache entries (checkpoints, pages) evicted under memory pressure or flushed.",
    ),
    _m(
        "gauge",
        "prefix_cache_checkpoints",
        "engine.prefix_cache_checkpoints",
        "State checkpoints held by the prefix cache (each one state slot).",
    ),
    _m(
        "gauge",
        "prefix_cache_checkpoint_bytes",
        "engine.prefix_cache_checkpoint_bytes",
        "Memory of the prefix cache's state checkpoints, over the whole model.",
    ),
    _m(
        "gauge",
        "prefix_cache_pages",
        "engine.prefix_cache_pages",
        "KV pages the prefix cache holds a reference to (shared pages counted once).",
    ),
    _m("gauge", "num_requests_running", "engine.num_running", "Requests in the running batch."),
    _m("gauge", "num_requests_waiting", "engine.num_waiting", "Requests waiting to be scheduled."),
    _m(
        "counter",
        "prompt_tokens_total",
        "engine.prompt_tokens_total",
        "Prompt tokens of requests that produced a first token.",
    ),
    _m("counter", "generation_tokens_total", "engine.generation_tokens_total", "Generated tokens."),
    _m(
        "counter",
        "spec_decode_num_drafts_total",
        "engine.spec_decode_num_drafts_by_method",
        "Speculative decoding: verify rows run (a request's proposals scored in one step).",
        "method",
    ),
    _m(
        "counter",
        "spec_decode_num_draft_tokens_total",
        "engine.spec_decode_num_draft_tokens_by_method",
        "Speculative decoding: tokens proposed and verified.",
        "method",
    ),
    _m(
        "counter",
        "spec_decode_num_accepted_tokens_total",
        "engine.spec_decode_num_accepted_tokens_by_method",
        "Speculative decoding: proposed tokens accepted.",
        "method",
    ),
    _m(
        "counter",
        "spec_decode_num_accepted_tokens_per_pos_total",
        "engine.spec_decode_num_accepted_tokens_per_pos",
        "Speculative decoding: proposals accepted at each position of a verify row "
        "(0 = the first proposal; one series per position up to k).",
        "position",
    ),
    _m(
        "histogram",
        "spec_decode_accepted_length",
        "engine.spec_decode_accepted_lengths",
        "Speculative decoding: proposals accepted per verify row (0..k).",
        buckets=ACCEPTED_LENGTH_BUCKETS,
    ),
    _m(
        "counter",
        "session_state_bundles_total",
        "engine.session_state_bundles",
        "Session state bundles by event: exported, imported (accepted), spilled (written to "
        "the session store) or restored (resumed from it; also counted as imported).",
        "event",
    ),
    _m(
        "counter",
        "session_state_bytes_total",
        "engine.session_state_bytes",
        "Bytes of the session state bundles counted in session_state_bundles_total, by event.",
        "event",
    ),
    _m(
        "counter",
        "session_state_refused_total",
        "engine.session_state_refused",
        "Session state bundles refused (the session re-prefills), by reason.",
        "reason",
        values=SESSION_STATE_REFUSALS,
    ),
    *LORA_METRICS,
    _m(
        "counter",
        "images_encoded_total",
        "engine.images_encoded_total",
        "Images run through the vision encoder (once more after a preemption).",
    ),
    _m(
        "counter",
        "encoder_seconds_total",
        "engine.encoder_seconds_total",
        "Seconds the vision encoder ran (TP rank 0's; every rank runs it).",
    ),
    _m(
        "counter",
        "request_success_total",
        "engine.finished_by_reason",
        "Finished requests, by finish reason.",
        "finished_reason",
    ),
    _m(
        "histogram",
        "time_to_first_token_seconds",
        "",
        "Time from a request's arrival to its first token.",
        buckets=TTFT_BUCKETS,
    ),
    _m(
        "histogram",
        "inter_token_latency_seconds",
        "",
        "Time between consecutive tokens of a request.",
        buckets=ITL_BUCKETS,
    ),
    _m(
        "histogram",
        "e2e_request_latency_seconds",
        "",
        "Time from arrival to the last token of a request that finished normally (stop or length).",
        buckets=E2E_BUCKETS,
    ),
    _m(
        "histogram",
        "step_duration_seconds",
        "",
        "Engine step time (schedule to emit) by phase: "
        "decode (all rows one token), extend (none), mixed.",
        "phase",
        buckets=STEP_BUCKETS,
    ),
)
BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}


def initial_series(
    pools: Sequence[str], positions: Sequence[str] = ()
) -> Iterator[tuple[MetricDef, dict[str, str]]]:
    """Every series that exists from start-up (label `pool` takes the engine's pools,
    `position` the speculative positions 0..k-1 of its config)."""
    engine_values = {"pool": pools, "position": positions}
    for m in METRICS:
        if not m.labels:
            yield m, {}
        for value in engine_values.get(m.labels[0], m.label_values) if m.labels else ():
            yield m, {m.labels[0]: value}


def read_source(
    m: MetricDef, stats: EngineStats, graphs: GraphStats | None
) -> Iterator[tuple[tuple[tuple[str, str], ...], float]]:
    """(labels, value) pairs of a gauge or counter now; nothing while its source is absent."""
    obj = stats if m.source.startswith("engine.") else graphs
    if obj is None:  # graphs off, or held by remote TP workers: the series stay at 0
        return
    value = getattr(obj, m.source.partition(".")[2])
    if isinstance(value, dict):
        yield from ((((m.labels[0], key),), v) for key, v in value.items())
    else:  # the only label a scalar source can have is `pool`: every pool shares the value
        yield from (((("pool", p),), value) for p in stats.pools) if m.labels else [((), value)]


__all__ = ["LORA_LOAD_REFUSALS", "METRICS", "BY_NAME", "Kind", "Labels", "MetricDef"]
