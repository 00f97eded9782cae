"""What the engine reads off the model class at build: a checkpoint's bytes and the name of a
model's extra state kind. Imported lazily by the registry's callers: the engine's modules do
not import the model classes at their own import time."""

from __future__ import annotations

from shortconv.configs.config import ModelConfig
from shortconv.execution.worker_spec import WorkerSpec


def checkpoint_bytes(spec: WorkerSpec) -> int:
    """What one state slot (so one prefix-cache checkpoint) costs, every state kind, summed
    over the model (at tp_size > 1 each rank holds its shard of it)."""
    from shortconv.execution.parallel import SINGLE
    from shortconv.models.registry import model_class

    specs = model_class(spec.model_cfg.arch).state_specs(spec.model_cfg, SINGLE)
    return sum(s.bytes_per_slot(spec.dtype.itemsize) for s in specs)


def extra_state_name(cfg: ModelConfig) -> str | None:
    """The model's state kind beside the short conv's (ZAYA1's `prev_state`), or None."""
    from shortconv.models.registry import model_class

    return getattr(model_class(cfg.arch), "extra_state_name", None)
