"""WorkerSpec: everything a rank needs to build its ModelRunner, decided once per engine.

The facade plans the spec (config, dtype, pool sizes, the KV-capped maximum length) before any
executor exists; the executor hands the same frozen spec to every rank (it crosses Ray, so it
stays picklable: plain paths, frozen dataclasses, torch dtype and device).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from shortconv.cache.kv_groups import kv_groups, window_page_bound
from shortconv.configs.config import EngineConfig, ModelConfig, resolve_dtype
from shortconv.errors import ConfigError
from shortconv.execution.head_shard import head_shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacity:
    """Pool sizes, decided once by the engine and identical on every rank."""

    num_slots: int
    num_pages: int  # KV group 0 (full attention): the pages that cap max_model_len
    window_pages: tuple[int, ...] = ()  # the sliding-window groups' pages (kv_groups 1..)

    @property
    def pages_per_group(self) -> tuple[int, ...]:
        return (self.num_pages, *self.window_pages)


@dataclass(frozen=True)
class WorkerSpec:
    """One engine's model and pools. `max_model_len` is the engine's limit (the model's
    maximum, capped to what one sequence's KV pages can hold): graph buckets follow it."""

    model_dir: Path
    model_cfg: ModelConfig
    engine_cfg: EngineConfig
    capacity: Capacity
    dtype: torch.dtype
    device: torch.device
    max_model_len: int


def plan_worker_spec(
    model: str | Path,
    engine_config: EngineConfig | None = None,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    tp_size: int = 1,
) -> WorkerSpec:
    """Read the checkpoint's config and size the pools for `tp_size` ranks (KV memory is
    accounted per rank); refuses a length that cannot fit."""
    model_dir = Path(model)
    cfg = ModelConfig.from_dir(model_dir)
    eng = engine_config or EngineConfig()
    torch_dtype = resolve_dtype(dtype, cfg.raw)
    max_len = eng.max_model_len or cfg.max_model_len
    if max_len > cfg.max_model_len:
        raise ConfigError(
            f"max_model_len={max_len} exceeds the model's "
            f"max_position_embeddings={cfg.max_model_len}"
        )
    capacity = plan_capacity(cfg, eng, max_len, torch_dtype, tp_size)
    max_len = _fit_max_len(max_len, capacity, eng)
    return WorkerSpec(model_dir, cfg, eng, capacity, torch_dtype, torch.device(device), max_len)


def plan_capacity(
    cfg: ModelConfig, eng: EngineConfig, max_len: int, dtype: torch.dtype, tp_size: int = 1
) -> Capacity:
    """Slots and KV pages per group (docs/kv_memory.md). A sliding-window group gets what its
    holders can keep (`_window_group_pages`); `num_kv_pages`, or else the rest of
    `kv_cache_bytes` (one rank's KV pool: a page costs a rank only the KV heads it holds, a
    replicated KV head costs every rank holding it), goes to the full group."""
    # Spare slots beyond max_num_seqs hold kept session checkpoints; prefix-cache checkpoints
    # get slots of their own on top.
    state_slots = eng.num_state_slots or 2 * eng.max_num_seqs + 1
    # Speculation: k more per running request, the states after each verified position
    # (cache.manager.CacheManager.spec_slots); they hold no KV pages of their own.
    extra_slots = eng.checkpoint_slots + eng.max_num_seqs * eng.num_speculative_tokens
    groups = kv_groups(cfg)
    windowed = tuple(_window_group_pages(g.window, eng, max_len, state_slots) for g in groups[1:])
    if eng.num_kv_pages:
        return Capacity(state_slots + extra_slots, eng.num_kv_pages, windowed)
    hk = head_shard(cfg.num_heads, cfg.num_kv_heads, tp_size).num_kv
    per_layer_page = 2 * eng.kv_page_size * hk * cfg.head_dim * dtype.itemsize
    window_bytes = sum(
        n * len(g.layer_ids) * per_layer_page for g, n in zip(groups[1:], windowed, strict=True)
    )
    # NOTE: a model without full-attention layers still keeps group 0's bookkeeping (its pages
    # cost nothing); it is sized as if it had one layer, as before groups existed.
    page_bytes = max(1, len(groups[0].layer_ids)) * per_layer_page
    budget_pages = max(2, (eng.kv_cache_bytes - window_bytes) // page_bytes)
    per_seq = -(-max_len // eng.kv_page_size)
    full = int(min(1 + eng.max_num_seqs * per_seq, budget_pages))
    return Capacity(state_slots + extra_slots, full, windowed)


def _window_group_pages(window: int, eng: EngineConfig, max_len: int, state_slots: int) -> int:
    """A sliding group's pages: every live request's window (`window_page_bound`), the pages a
    step's prefill chunks add on top (its token budget, plus one straddled page per row), and
    as many windows again for the checkpoints sessions keep in the spare state slots; the
    prefix cache's other checkpoints take what is left and are evicted LRU under pressure."""
    ps = eng.kv_page_size
    per_request = min(window_page_bound(window, ps), -(-max_len // ps))
    live = eng.max_num_seqs * (per_request + 1) + -(-eng.max_num_batched_tokens // ps)
    kept = max(0, state_slots - 1 - eng.max_num_seqs) * per_request
    return 1 + live + kept


def _fit_max_len(max_len: int, capacity: Capacity, eng: EngineConfig) -> int:
    """A sequence must fit the KV pool on its own, or it would preempt itself forever. Only
    the full group (group 0) holds a sequence's whole context: a sliding group's share is
    sized to its windows, so it never caps the length.

    An explicit max_model_len that does not fit is refused; the model's default is capped to
    what fits (like vLLM), with a warning.
    """
    fits = (capacity.num_pages - 1) * eng.kv_page_size
    if max_len <= fits:
        return max_len
    if eng.max_model_len:
        raise ConfigError(
            f"max_model_len={max_len} needs {-(-max_len // eng.kv_page_size)} KV pages but the "
            f"pool has {capacity.num_pages - 1}; raise num_kv_pages / kv_cache_bytes or lower "
            "max_model_len"
        )
    log.warning("KV pool holds %d tokens: capping max_model_len %d -> %d", fits, max_len, fits)
    return fits
