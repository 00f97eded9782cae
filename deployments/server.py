"""LLMServer: the model deployment — one AsyncEngine behind the typed methods OpenAIIngress
calls (deployments/replica_api.py, implemented by OpenAIReplica); it never sees HTTP.

The engine is injected (`engine_factory`, an import path), so the same deployment runs under a
real `serve.run` with a fake engine in tests. With tp_size > 1 the executor's TP workers land in
this replica's placement group (bundle index = rank), so a replica and its workers come and go
together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import logging
import sys
import time
from typing import Any

from ray import serve

from deployments.args import AppArgs
from deployments.async_engine import AsyncEngine
from deployments.chat_images import ChatImages
from deployments.engine_types import EngineLike
from deployments.metrics_sink import attach_ray_metrics
from deployments.model_source import resolve_model, served_model_name
from deployments.openai_api import ApiConfig, OpenAIReplica
from shortconv.engine.stats import StartupReport
from workers.cpu_threads import follow_reservation
from workers.startup import PhaseClock

log = logging.getLogger(__name__)
# NOTE: inside a replica only Serve's logger reaches the replica's log and `serve run`'s output
# (the root logger drops INFO), so what a user must see at start goes through it.
serve_log = logging.getLogger("ray.serve")


def build_engine(args: AppArgs, clock: PhaseClock | None = None) -> EngineLike:
    """The real engine (the default `engine_factory`). `clock` gets the start-up phases: the
    checkpoint, the runner's own (weights, prepacking, state pool, graph capture) when the model
    runs in this process, and the rest of the engine's start (with tp_size > 1 the TP workers',
    each of which reports its own phases)."""
    from shortconv.llm import build_engine as build_llm_engine

    clock = clock if clock is not None else PhaseClock()
    with clock.phase("checkpoint"):
        model_dir = resolve_model(args)
    log.info("loading %s (tp_size=%d, %s)", model_dir, args.tp_size, args.device)
    t0 = time.perf_counter()
    engine = build_llm_engine(
        model_dir,
        tp_size=args.tp_size,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        engine_config=args.engine_config(),
    )
    inner = engine.executor.startup_phases()  # tp_size=1: the model is in this process
    clock.add(inner)
    clock.phases.append(("engine", time.perf_counter() - t0 - sum(inner.values())))
    return engine


def startup_summary(report: StartupReport, threads: int, engine: EngineLike) -> dict[str, Any]:
    """The replica's start-up report for its stats (and the log): phases, memory, threads, and
    each TP rank's own report."""
    ranks = engine.startup_reports()
    serve_log.info("%s; torch threads %d", report.line(), threads)
    for rank in ranks:
        serve_log.info("%s", rank.line())
    return {
        **dataclasses.asdict(report),
        "torch_threads": threads,
        "gil_switch_interval_ms": round(sys.getswitchinterval() * 1000.0, 3),
        "weight_bytes": dict(engine.weight_bytes),  # rank 0's, read at start
        "ranks": [dataclasses.asdict(r) for r in ranks],
    }


def import_attr(path: str) -> Any:
    """`pkg.module:attr` (or `pkg.module.attr`) -> the attribute."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def share_the_gil(interval_ms: float) -> None:
    """Set this process's GIL switch interval.

    Why: the engine thread releases the GIL inside every torch op and must take it back after
    each one (over a thousand a decode step); meanwhile the replica's event loops (ours and
    Serve's, Ray's callbacks) relay the previous step's tokens in Python. Whenever one of them
    holds the GIL, the engine thread waits until it lets go or is made to, after the switch
    interval: 5 ms by default, enough to turn a 1.3 ms GEMM into 18 ms against one busy Python
    thread (0.5 ms: 1.4 ms; docs/serving_path.md). The event loops' work is short bursts, so a
    shorter interval costs them little."""
    sys.setswitchinterval(interval_ms / 1000.0)
    serve_log.info("GIL switch interval %.2f ms", interval_ms)


@serve.deployment(name="LLMServer")
class LLMServer(OpenAIReplica):
    """One replica: the engine loop, the OpenAI methods, and session and prefix reports for
    the router. NOTE: not an ingress: only OpenAIIngress speaks HTTP."""

    async def __init__(
        self,
        args: dict[str, Any],
        engine_factory: str | None = None,
    ) -> None:
        import torch  # NOTE: here: the app's build task imports this module, never torch

        app_args = AppArgs.model_validate(args)
        clock = PhaseClock()  # NOTE: first, so `before_s` is the process's life before us
        share_the_gil(app_args.gil_switch_interval_ms)
        # tp_size > 1: the ranks compute, each following its own reservation.
        threads = (
            follow_reservation("replica") if app_args.tp_size == 1 else torch.get_num_threads()
        )
        factory = (
            import_attr(engine_factory)
            if engine_factory
            else functools.partial(build_engine, clock=clock)
        )
        # NOTE: loading happens off the event loop so the replica stays responsive to Serve.
        t0 = time.perf_counter()
        engine = await asyncio.to_thread(factory, app_args)
        if engine_factory:
            clock.phases.append(("engine", time.perf_counter() - t0))
        with clock.phase("processor"):  # the checkpoint's processor, for chat images
            images = await asyncio.to_thread(ChatImages.for_engine, engine, app_args.images)
        with clock.phase("loop"):
            # NOTE: before the loop starts, so every series exists (at 0) from the replica's
            # start; inside a replica Ray tags them with application, deployment and replica.
            attach_ray_metrics(engine)
            loop = AsyncEngine(engine, admission_limit=app_args.admission_limit)
            loop.start()
        replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        name = served_model_name(app_args)
        super().__init__(loop, ApiConfig(name, replica_id, app_args.request_timeout_s), images)
        self.startup = startup_summary(clock.report("replica"), threads, engine)
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
