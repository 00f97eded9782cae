"""The application's arguments (the YAML `args:` block), validated at the edge with pydantic.

One chain: `AppArgs` extends `EngineArgs`, whose fields are named as `EngineConfig`'s and
become it in one call (`engine_config()`), so the YAML keys stay flat and nothing is copied
field by field; `EngineConfig`'s own checks run when the args are validated.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shortconv.configs.config import EngineConfig

BatchSize = Annotated[int, Field(ge=1)]


class EngineArgs(BaseModel):
    """The engine's knobs a deployment sets (each an `EngineConfig` field of the same name;
    None keeps the engine's default).

    `enable_graphs` runs decode steps as graph replays (CUDA graphs on GPU; None: on for CUDA,
    off for CPU); `graph_batch_sizes` is their batch-size ladder; a decode batch larger than the
    largest bucket runs eagerly (counted in shortconv_graph_eager_fallbacks_total).
    `prepack_cpu_weights` (CPU, fp32) keeps a oneDNN-blocked copy of each large linear weight,
    faster from 8 rows per step up, at the cost of about the weights' size again in memory.
    `enable_prefix_caching` reuses any earlier request's cached prefix (KV pages shared, state
    checkpointed every `prefix_checkpoint_interval` prompt tokens (0: 64 in whole KV pages) and
    at every end of prompt and of generation, in `num_checkpoint_slots` extra state slots (0: 8
    per max_num_seqs)); see shortconv/cache/prefix_cache.py. A kept session is dropped after
    `session_ttl_s` idle.
    """

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    num_state_slots: int = Field(0, ge=0)
    max_model_len: int = Field(0, ge=0)
    session_ttl_s: float = Field(600.0, gt=0)
    enable_graphs: bool | None = None
    graph_batch_sizes: Annotated[tuple[BatchSize, ...], Field(min_length=1)] | None = None
    prepack_cpu_weights: bool = True
    enable_prefix_caching: bool = True
    prefix_checkpoint_interval: int = Field(0, ge=0)
    num_checkpoint_slots: int = Field(0, ge=0)

    def engine_config(self) -> EngineConfig:
        fields = self.model_dump(include=set(EngineArgs.model_fields), exclude_none=True)
        return EngineConfig(**fields)

    @model_validator(mode="after")
    def _engine_checks(self) -> EngineArgs:
        self.engine_config()  # NOTE: EngineConfig's ConfigError is a ValueError: a 400 here
        return self


class AppArgs(EngineArgs):
    """Arguments of `deployments.app:build`: the engine's (EngineArgs) and the app's own.

    `model` is a checkpoint directory; when it is None the app serves a tiny random checkpoint
    of `tiny_arch`, built by `shortconv.tiny.checkpoint` on first start and cached.
    `seed` seeds the tiny checkpoint and the sampling of requests that bring no seed.
    `replica_num_cpus` is what Ray reserves for the LLMServer replica itself (TP workers get
    their own bundles when tp_size > 1).
    `max_waiting_requests` (default: `max_num_seqs`) is how many admitted requests may wait
    for a batch place: a replica admits `admission_limit` = `max_num_seqs` +
    `max_waiting_requests` requests and answers the next one 503 (see deployments/app.py for
    the Serve options derived from it).
    `min_replicas` / `max_replicas` bound Serve's autoscaling of the replica; the rest of the
    Serve options (the autoscaling target, concurrency caps) are derived from these args in
    deployments/app.py, so a YAML sets a `deployments:` entry only to override one of them.
    """

    model: str | None = None
    served_model_name: str | None = None
    tiny_arch: Literal["lfm2", "lfm2_moe", "zaya1"] = "zaya1"
    tp_size: int = Field(1, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    max_waiting_requests: int | None = Field(None, ge=1)  # None: max_num_seqs
    max_request_bytes: int = Field(1 << 20, ge=1024)
    request_timeout_s: float = Field(600.0, gt=0)  # queueing to last token; then aborted (504)
    api_key: str | None = None  # None: $SHORTCONV_API_KEY if set, else no auth
    model_root: str | None = None
    seed: int = 0
    replica_num_cpus: float = Field(0.5, gt=0)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _replica_bounds(self) -> AppArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must not exceed max_replicas "
                f"({self.max_replicas})"
            )
        return self

    @property
    def admission_limit(self) -> int:
        """Requests one replica holds (running + waiting); past it, 503 + Retry-After."""
        waiting = self.max_waiting_requests or self.max_num_seqs
        return self.max_num_seqs + waiting
