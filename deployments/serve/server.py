"""LLMServer: the model deployment — one AsyncEngine behind the typed methods OpenAIIngress
calls (deployments/frontend/openai/replica.py, implemented by OpenAIReplica); it never sees HTTP.

The engine is injected (`engine_factory`, an import path), so the same deployment runs under a
real `serve.run` with a fake engine in tests. With tp_size > 1 the executor's TP workers land in
this replica's placement group (bundle index = rank), so a replica and its workers come and go
together; with `engine_process` their driver (and owner) is the replica's engine core process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.frontend.config.args import AppArgs
from deployments.frontend.config.model_source import served_model_name
from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.engine.core_client import CoreEngine
from deployments.frontend.engine.engine_build import build_engine, make_engine
from deployments.frontend.engine.engine_types import EngineLike
from deployments.frontend.images.chat_images import ChatImages
from deployments.frontend.openai.api import ApiConfig, OpenAIReplica
from deployments.frontend.openai.handoff import DecodeHandoff
from deployments.serve.metrics_sink import RayMetricsSink, attach_ray_metrics
from shortconv.engine.stats import StartupReport
from workers.cluster_seat import this_replicas_seat
from workers.cpu_threads import core_threads, follow_reservation
from workers.startup import PhaseClock

__all__ = ["LLMServer", "build_engine", "start_engine", "startup_summary"]

log = logging.getLogger(__name__)
# NOTE: inside a replica only Serve's logger reaches the replica's log and `serve run`'s output
# (the root logger drops INFO), so what a user must see at start goes through it.
serve_log = logging.getLogger("ray.serve")


def startup_summary(
    report: StartupReport, threads: int | None, engine: EngineLike
) -> dict[str, Any]:
    """The replica's start-up report for its stats (and the log): phases, memory, threads, and
    each TP rank's own report."""
    ranks = engine.startup_reports()
    serve_log.info("%s; torch threads %s", report.line(), threads or "torch's default")
    core: StartupReport | None = getattr(engine, "core_report", None)
    for rank in ([core] if core else []) + ranks:
        serve_log.info("%s", rank.line())
    return {
        "core": dataclasses.asdict(core) if core else None,  # the engine core process's
        **dataclasses.asdict(report),
        "torch_threads": threads,
        "gil_switch_interval_ms": round(sys.getswitchinterval() * 1000.0, 3),
        "weight_bytes": dict(engine.weight_bytes),  # rank 0's, read at start
        "ranks": [dataclasses.asdict(r) for r in ranks],
    }


# The GIL switch interval a replica sets when the engine steps on its thread.
THREAD_ENGINE_GIL_MS = 0.5


def gil_interval_ms(args: AppArgs) -> float | None:
    """The replica's GIL switch interval: `gil_switch_interval_ms` when set; else None (keep
    Python's 5 ms) where a core process runs the engine, since the replica's thread then only
    waits on the pipe and relays (5 against 0.5 ms measured without a difference:
    docs/serving_path.md); else the shorter interval of `share_the_gil`."""
    if args.gil_switch_interval_ms is not None:
        return args.gil_switch_interval_ms
    return None if in_core(args) else THREAD_ENGINE_GIL_MS


def share_the_gil(interval_ms: float | None) -> None:
    """Set this process's GIL switch interval (None: leave Python's).

    Why, for an engine on the replica's thread: that thread releases the GIL inside every
    torch op and must take it back after each one (over a thousand a decode step); meanwhile
    the replica's event loops (ours and Serve's, Ray's callbacks) relay the previous step's
    tokens in Python. Whenever one of them holds the GIL, the engine thread waits until it
    lets go or is made to, after the switch interval: 5 ms by default, enough to turn a 1.3 ms
    GEMM into 18 ms against one busy Python thread (0.5 ms: 1.4 ms; docs/serving_path.md).
    The event loops' work is short bursts, so a shorter interval costs them little."""
    if interval_ms is not None:
        sys.setswitchinterval(interval_ms / 1000.0)
    serve_log.info("GIL switch interval %.2f ms", sys.getswitchinterval() * 1000.0)


def in_core(args: AppArgs) -> bool:
    """Whether the engine runs in a core process (`engine_process`; at tp_size > 1 the core
    drives the TP workers): then this process computes nothing and never imports torch
    (tests/repo/test_replica_imports.py)."""
    return args.engine_process


def launch_core(
    args: AppArgs, engine_factory: str | None, threads: int | None
) -> Callable[[], CoreEngine]:
    """Start the core process; with tp_size > 1 it joins this replica's cluster and places the
    TP workers in this replica's placement group, as the engine would here."""
    seat = this_replicas_seat() if args.tp_size > 1 else None
    return CoreEngine.launch(args.model_dump(), engine_factory, threads, seat)


def engine_threads(args: AppArgs) -> int | None:
    """The engine's torch threads: `torch_threads` when set, else following this replica's
    CPU reservation: a core process's, read without torch (None outside Ray: torch's default
    there; at tp_size > 1 the ranks compute, each following its own reservation); else this
    process's own, which imports torch (tp_size > 1: this one keeps torch's count)."""
    if in_core(args):
        return args.torch_threads or core_threads()
    import torch  # NOTE: here: the app's build task imports this module, never torch

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
        return args.torch_threads
    return follow_reservation("replica") if args.tp_size == 1 else torch.get_num_threads()


def start_engine(
    args: AppArgs,
    engine_factory: str | None,
    clock: PhaseClock,
    threads: int | None,
    launched: Callable[[], CoreEngine] | None = None,
) -> EngineLike:
    """The replica's engine: in its own core process (`in_core`; `launched` already, else
    started here), else in this one. The core's start is one phase here; its own phases are
    its start-up report."""
    if launched is None and in_core(args):
        launched = launch_core(args, engine_factory, threads)
    if launched is not None:
        t0 = time.perf_counter()
        core = launched()
        waited, phases = time.perf_counter() - t0, dict(core.core_report.phases)
        # NOTE: the core's phases are the replica's start path; before them, its interpreter
        # (0 when the core was ready before the replica's own imports were done).
        clock.phases.append(("core_process", max(0.0, waited - sum(phases.values()))))
        clock.add(phases)
        serve_log.info("engine core process %d ready", core.pid)
        return core
    return make_engine(args, engine_factory, clock)


@serve.deployment(name="LLMServer")
class LLMServer(OpenAIReplica):
    """One replica: the engine loop, the OpenAI methods, and session and prefix reports for
    the router. NOTE: not an ingress: only OpenAIIngress speaks HTTP."""

    async def __init__(
        self,
        args: dict[str, Any],
        engine_factory: str | None = None,
        prefill: DeploymentHandle | None = None,
    ) -> None:
        """`prefill`: in a disaggregated app (deployments/serve/disagg_app.py), the prefill
        deployment this decode replica takes prompts' state from; None: it prefills itself.
        A prefill replica is this same class, called only on `prefill`."""
        clock = PhaseClock()  # NOTE: first, so `before_s` is the process's life before us
        app_args = AppArgs.model_validate(args)
        launched = None
        if in_core(app_args):  # NOTE: first, so the core's start overlaps all that follows
            launched = launch_core(app_args, engine_factory, engine_threads(app_args))
        with clock.phase("imports"):  # the engine's imports when it runs in this process
            share_the_gil(gil_interval_ms(app_args))
            threads = engine_threads(app_args)
        # NOTE: loading happens off the event loop so the replica stays responsive to Serve.
        engine = await asyncio.to_thread(
            start_engine, app_args, engine_factory, clock, threads, launched
        )
        with clock.phase("processor"):  # the checkpoint's processor, for chat images
            images = await asyncio.to_thread(ChatImages.for_engine, engine, app_args.images)
        with clock.phase("loop"):
            # NOTE: before the loop starts, so every series exists (at 0) from the replica's
            # start; inside a replica Ray tags them with application, deployment and replica.
            if isinstance(engine, CoreEngine):
                engine.relay_metrics_to(RayMetricsSink())  # the core records, we export
            else:
                attach_ray_metrics(engine)
            loop = AsyncEngine(engine, admission_limit=app_args.admission_limit)
            loop.start()
        replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        name = served_model_name(app_args)
        loras = tuple((app_args.lora_modules or {}).items())
        cfg = ApiConfig(name, replica_id, app_args.request_timeout_s, loras)
        handoff = DecodeHandoff(loop, prefill.prefill.remote) if prefill is not None else None
        super().__init__(loop, cfg, images, handoff)
        self.startup = startup_summary(clock.report("replica"), threads, engine)
        log.info("replica %s ready", replica_id)

    async def check_health(self) -> None:
        """Serve's health check: the engine loop must be alive and every TP worker answer."""
        await self.engine.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        """Sessions this replica holds state for (session id -> last activity, epoch seconds),
        the prefix hashes of prompts it served (sorted ints) and the LoRA adapters it holds;
        SessionAffinityRouter sends a session's next turn, a request with a known prefix, or
        one for an adapter held here, here. Serve re-broadcasts the
        stats only when they change: a session comes, goes or takes a turn, a prefix is new."""
        return {
            "sessions": dict(self.engine.stats().get("sessions", {})),
            "prefixes": self.prefixes.report(),
            "loras": sorted(self.loras.paths),  # the adapters held here (lora_holders.py)
            "loras_at": self.loras.changed_at,  # when that list last changed
        }

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
