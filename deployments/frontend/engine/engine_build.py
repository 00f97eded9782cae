"""Building a replica's engine (Ray-free: the engine core process imports it too)."""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

from deployments.frontend.config.args import AppArgs
from deployments.frontend.config.model_source import resolve_model
from deployments.frontend.engine.engine_types import EngineLike
from workers.cluster_seat import ClusterSeat, executor_options
from workers.startup import PhaseClock

log = logging.getLogger(__name__)


def build_engine(
    args: AppArgs, clock: PhaseClock | None = None, seat: ClusterSeat | None = None
) -> EngineLike:
    """The real engine (the default `engine_factory`). `clock` gets the start-up phases: the
    checkpoint, the runner's own (weights, prepacking, state pool, graph capture) when the model
    runs in this process, and the rest of the engine's start (with tp_size > 1 the TP workers',
    each of which reports its own phases). `seat`: the replica's placement group, where an
    engine core process (joined to the replica's cluster) puts the TP workers."""
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
        executor_options=executor_options(seat) if seat is not None else None,
    )
    inner = engine.executor.startup_phases()  # tp_size=1: the model is in this process
    clock.add(inner)
    clock.phases.append(("engine", time.perf_counter() - t0 - sum(inner.values())))
    return engine


def import_attr(path: str) -> Any:
    """`pkg.module:attr` (or `pkg.module.attr`) -> the attribute."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def make_engine(
    args: AppArgs, engine_factory: str | None, clock: PhaseClock, seat: ClusterSeat | None = None
) -> EngineLike:
    """The injected factory's engine (its build timed as one phase), else the real one."""
    if not engine_factory:
        return build_engine(args, clock, seat)
    with clock.phase("engine"):
        return import_attr(engine_factory)(args)
