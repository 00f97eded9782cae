"""The multi-LoRA metrics (docs/lora.md): adapters resident, requests and generated tokens by
adapter, loads, unloads, evictions and refused loads. Part of shortconv.metrics.defs.METRICS."""

from __future__ import annotations

from shortconv.metrics.metric_def import MetricDef, metric

# Why a LoRA adapter's load was refused (`lora.adapter.LoraError.reason`): its files missing
# or unreadable, PEFT options or config not implemented, a target module this model does not
# adapt, a rank above max_lora_rank, a shape of another base, a name already loaded, or every
# slot serving live requests.
LORA_LOAD_REFUSALS = ("files", "options", "target", "rank", "shape", "duplicate", "no_slot")

LORA_METRICS: tuple[MetricDef, ...] = (
    metric(
        "gauge",
        "lora_adapters_resident",
        "engine.lora_adapters_resident",
        "LoRA adapters resident in this replica's slots (at most max_loras).",
    ),
    metric(
        "counter",
        "lora_requests_total",
        "engine.lora_requests",
        'Requests by LoRA adapter name ("" = the base model; series from each adapter\'s load, '
        'kept after its unload; past 64 names, "_other").',
        "lora",
    ),
    metric(
        "counter",
        "lora_generation_tokens_total",
        "engine.lora_generation_tokens",
        "Generated tokens by LoRA adapter name (labels as lora_requests_total).",
        "lora",
    ),
    metric("counter", "lora_loads_total", "engine.lora_loads", "LoRA adapters loaded."),
    metric("counter", "lora_unloads_total", "engine.lora_unloads", "LoRA adapters unloaded."),
    metric(
        "counter",
        "lora_evictions_total",
        "engine.lora_evictions",
        "LoRA adapters evicted from their slot (least recently used) for another; an evicted "
        "adapter stays loaded and is written back on its next request.",
    ),
    metric(
        "counter",
        "lora_load_refusals_total",
        "engine.lora_load_refusals",
        "LoRA adapter loads refused, by reason.",
        "reason",
        values=LORA_LOAD_REFUSALS,
    ),
)
