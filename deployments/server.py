"""LLMServer: the model deployment — one AsyncEngine behind the typed methods OpenAIIngress
calls (deployments/replica_api.py, implemented by OpenAIReplica); it never sees HTTP.

The engine is injected (`engine_factory`, an import path), so the same deployment runs under a
real `serve.run` with a fake engine in tests. With tp_size > 1 the executor's TP workers land in
this replica's placement group (bundle index = rank), so a replica and its workers come and go
together.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
from typing import Any

from ray import serve

from deployments.args import AppArgs
from deployments.async_engine import AsyncEngine
from deployments.engine_types import EngineLike
from deployments.metrics_sink import attach_ray_metrics
from deployments.model_source import resolve_model, served_model_name
from deployments.openai_api import ApiConfig, OpenAIReplica
from workers.cpu_threads import follow_reservation

log = logging.getLogger(__name__)


def build_engine(args: AppArgs, worker_num_cpus: float | None = None) -> EngineLike:
    """The real engine (the default `engine_factory`); with tp_size > 1 each rank reserves
    `worker_num_cpus` (deployments/cpu_plan.py), its bundle in the replica's group."""
    from shortconv.engine.llm_engine import LLMEngine
    from shortconv.execution.worker_spec import plan_worker_spec
    from shortconv.llm import build_executor

    model_dir = resolve_model(args)
    log.info("loading %s (tp_size=%d, %s)", model_dir, args.tp_size, args.device)
    spec = plan_worker_spec(model_dir, args.engine_config(), args.dtype, args.device, args.tp_size)
    ray_options = {} if worker_num_cpus is None else {"num_cpus_per_worker": worker_num_cpus}
    executor = build_executor(spec, args.tp_size, **ray_options)
    return LLMEngine(spec, executor, seed=args.seed)


def import_attr(path: str) -> Any:
    """`pkg.module:attr` (or `pkg.module.attr`) -> the attribute."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@serve.deployment(name="LLMServer")
class LLMServer(OpenAIReplica):
    """One replica: the engine loop, the OpenAI methods, and session and prefix reports for
    the router. NOTE: not an ingress: only OpenAIIngress speaks HTTP."""

    async def __init__(
        self,
        args: dict[str, Any],
        engine_factory: str | None = None,
        worker_num_cpus: float | None = None,
    ) -> None:
        app_args = AppArgs.model_validate(args)
        if app_args.tp_size == 1:
            follow_reservation("replica")  # tp_size > 1: the ranks compute, each its own
        factory = (
            import_attr(engine_factory)
            if engine_factory
            else functools.partial(build_engine, worker_num_cpus=worker_num_cpus)
        )
        # NOTE: loading happens off the event loop so the replica stays responsive to Serve.
        engine = await asyncio.to_thread(factory, app_args)
        # NOTE: before the loop starts, so every series exists (at 0) from the replica's start;
        # inside a replica Ray tags them with application, deployment and replica.
        attach_ray_metrics(engine)
        loop = AsyncEngine(engine, admission_limit=app_args.admission_limit)
        loop.start()
        replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        name = served_model_name(app_args)
        super().__init__(loop, ApiConfig(name, replica_id, app_args.request_timeout_s))
        log.info("replica %s ready", replica_id)

    async def check_health(self) -> None:
        """Serve's health check: the engine loop must be alive and every TP worker answer."""
        await self.engine.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        """Sessions this replica holds state for (session id -> last activity, epoch seconds)
        and the prefix hashes of prompts it served (sorted ints); SessionAffinityRouter sends
        a session's next turn, or a request with a known prefix, here. Serve re-broadcasts the
        stats only when they change: a session comes, goes or takes a turn, a prefix is new."""
        return {
            "sessions": dict(self.engine.stats().get("sessions", {})),
            "prefixes": self.prefixes.report(),
        }

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
