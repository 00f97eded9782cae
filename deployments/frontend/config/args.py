"""The application's arguments (the YAML `args:` block), validated at the edge with pydantic.

One chain: `AppArgs` extends `EngineArgs`, which is generated from `EngineConfig`'s dataclass
fields (names, types, defaults and bounds), so the YAML keys stay flat, no engine field is
declared twice, and `engine_config()` builds the config in one call; `EngineConfig`'s own
checks run when the args are validated.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from deployments.frontend.config.disaggregation import DisaggregationArgs, disaggregation_refusal
from deployments.frontend.images.limits import ImageLimits
from shortconv.configs.config import EngineConfig


def _engine_fields() -> dict[str, Any]:
    """EngineConfig's fields as pydantic fields: the same names, types, defaults and bounds."""
    hints = get_type_hints(EngineConfig)
    return {
        f.name: (hints[f.name], Field(f.default, **f.metadata))
        for f in dataclasses.fields(EngineConfig)
    }


class _EngineArgsBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{name: getattr(self, name) for name in ENGINE_FIELDS})

    @model_validator(mode="after")
    def _engine_checks(self) -> _EngineArgsBase:
        self.engine_config()  # NOTE: EngineConfig's ConfigError is a ValueError: a 400 here
        return self


ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))
# The engine's knobs, generated from EngineConfig (see its field comments for each one's
# meaning); a deployment's YAML sets them flat beside the app's own args.
EngineArgs = create_model("EngineArgs", __base__=_EngineArgsBase, **_engine_fields())


class AppArgs(EngineArgs):
    """Arguments of `deployments.serve.app:build`: the engine's (EngineArgs) and the app's own.

    `model` is a checkpoint directory; when it is None the app serves a tiny random checkpoint
    of `tiny_arch`, built by `shortconv.tiny.checkpoint` on first start and cached.
    `seed` seeds the tiny checkpoint and the sampling of requests that bring no seed.
    `replica_num_cpus` is what Ray reserves for the LLMServer replica itself (TP workers get
    their own bundles when tp_size > 1), and so the engine's torch threads; `all` gives one
    replica every CPU of the node (the shipped YAMLs), split with its ranks when tp_size > 1.
    `max_waiting_requests` (default: `max_num_seqs`) is how many admitted requests may wait
    for a batch place: a replica admits `admission_limit` = `max_num_seqs` +
    `max_waiting_requests` requests and answers the next one 503 (see deployments/serve/app.py for
    the Serve options derived from it).
    `responses_ttl_s` / `max_stored_responses`: how long a stored Responses API response (and
    its conversation, for `previous_response_id`) is kept (by the ingress, or by the app's
    ResponseStore deployment where ingress replicas share one: deployments/serve/app.py), and how
    many at once (the oldest go first); deployments/frontend/responses/store.py.
    `torch_threads`: the engine's torch threads, set outright (llama.cpp's `-t`); None
    (default) follows the replica's CPU reservation. For one machine shared by replicas that
    are rarely busy at once (a prefill and a decode replica), each may use every core while
    reserving a share. tp_size > 1 refuses it: each rank follows its own reservation.
    `gil_switch_interval_ms`: the replica process's `sys.setswitchinterval`, how long a Python
    thread may keep the GIL while another waits for it (Python's default: 5 ms). None (default):
    Python's own where the engine runs in a core process (the replica only relays; measured
    without a difference in docs/serving_path.md), 0.5 ms where the engine steps on a thread of
    the replica, which waits for the GIL after every op while Serve's event loops relay the
    last step's tokens (deployments/serve/server.py).
    `engine_process`: run the engine (scheduler, cache manager, rank 0) in a core process of
    its own that the replica spawns and owns (deployments/frontend/engine/engine_core.py), so no
    Serve event loop shares its GIL; False steps it on a thread of the replica. With tp_size > 1
    the core is the TP workers' driver: it joins the replica's cluster and places them in the
    replica's placement group (workers/cluster_seat.py).
    `engine_niceness`: the core process's nice value. Ray starts its workers, so the replica and
    anything it spawns, at nice 15; the core moves itself here first thing
    (workers/process_priority.py: needs CAP_SYS_NICE to go lower, else it logs why it could not).
    `runtime_lora_updating`: serve `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
    (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; needs `enable_lora`). Off: only the YAML's
    `lora_modules` are served, and the two routes do not exist (404).
    `min_replicas` / `max_replicas` bound Serve's autoscaling of the replica; the rest of the
    Serve options (the autoscaling target, concurrency caps) are derived from these args in
    deployments/serve/app.py, so a YAML sets a `deployments:` entry only to override one of them.
    `disaggregation`: prefill and decode on deployments of their own
    (deployments/frontend/config/disaggregation.py); off (None) by default.
    """

    model: str | None = None
    served_model_name: str | None = None
    tiny_arch: Literal["lfm2", "lfm2_moe", "lfm3", "zaya1", "lfm2_vl", "lfm3_vl"] = "zaya1"
    tp_size: int = Field(1, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    max_waiting_requests: int | None = Field(None, ge=1)  # None: max_num_seqs
    max_request_bytes: int = Field(1 << 20, ge=1024)
    request_timeout_s: float = Field(600.0, gt=0)  # queueing to last token; then aborted (504)
    api_key: str | None = None  # None: $SHORTCONV_API_KEY if set, else no auth
    model_root: str | None = None
    seed: int = 0
    # "all": the whole node for one replica (deployments/serve/cpu_plan.py); torch threads follow
    # it.
    replica_num_cpus: Annotated[float, Field(gt=0)] | Literal["all"] = 0.5
    torch_threads: int | None = Field(None, ge=1)
    responses_ttl_s: float = Field(3600.0, gt=0)
    max_stored_responses: int = Field(10_000, ge=1)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    images: ImageLimits = ImageLimits()  # chat image parts (deployments/frontend/images/limits.py)
    gil_switch_interval_ms: float | None = Field(None, gt=0, le=100)
    engine_process: bool = True
    engine_niceness: int = Field(0, ge=-20, le=19)
    runtime_lora_updating: bool = False
    disaggregation: DisaggregationArgs | None = None  # docs/disaggregation.md

    @model_validator(mode="after")
    def _replica_bounds(self) -> AppArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must not exceed max_replicas "
                f"({self.max_replicas})"
            )
        if self.torch_threads is not None and self.tp_size > 1:
            raise ValueError(
                "torch_threads needs tp_size=1: with tp_size > 1 each rank's torch threads "
                "follow its own CPU reservation"
            )
        if self.runtime_lora_updating and not self.enable_lora:
            raise ValueError("runtime_lora_updating needs enable_lora=True")
        refusal = None
        if self.disaggregation is not None:
            bounds = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas}
            given = {k: v for k, v in bounds.items() if k in self.model_fields_set}
            refusal = disaggregation_refusal(
                self.disaggregation, given, self.enable_lora, self.replica_num_cpus
            )
        if refusal is not None:
            raise ValueError(refusal)
        return self

    @property
    def admission_limit(self) -> int:
        """Requests one replica holds (running + waiting); past it, 503 + Retry-After."""
        waiting = self.max_waiting_requests or self.max_num_seqs
        return self.max_num_seqs + waiting
