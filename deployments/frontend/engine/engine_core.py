"""The engine core process: a replica's LLMEngine (scheduler, cache manager, rank 0 or the TP
driver) stepping in a process of its own, so no Serve event loop shares its GIL.

`run_core` is the process's target (spawned: deployments/frontend/engine/core_client.py). It builds
the engine,
says `Ready`, then loops: take every waiting command, step, send the step's deltas as one
`StepOut`. Detokenization and stop strings stay here, inside `LLMEngine.step` (why:
docs/serving_path.md). It exits when told to, when its loop crashes (after `Died`), and when
the replica is gone (its end of the pipe reads EOF), so it never outlives its owner.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from deployments.frontend.config.args import AppArgs
from deployments.frontend.engine.core_messages import (
    Add,
    Call,
    Cancel,
    CheckGrammar,
    Died,
    Inbound,
    Ready,
    Reply,
    Shutdown,
    Start,
    StateCall,
    Status,
    StepOut,
    recv,
    send,
)
from deployments.frontend.engine.core_tokenizer import core_sends_tokenizer
from deployments.frontend.engine.engine_build import make_engine
from deployments.frontend.engine.engine_types import (
    CoreOutput,
    Delta,
    EngineLike,
    delta_of,
    executor_error,
    grammar_error,
    request_extras,
    update_lora,
)
from deployments.frontend.engine.metrics_relay import RelaySink
from deployments.frontend.engine.state_ops import run_state_op
from shortconv.engine.outputs import FinishReason
from shortconv.metrics.recorder import attach_metrics
from workers.cluster_seat import join_cluster
from workers.heap_trim import heap_trimmer
from workers.process_priority import set_niceness
from workers.startup import PhaseClock

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # an idle core wakes this often to expire sessions and refresh gauges


class _Stop(Exception):
    """The replica asked the core to stop, or is gone."""


class EngineCore:
    """The loop of the core process over one engine; `relay` carries its metric updates;
    `trim_heap` runs each time the engine goes idle (workers/heap_trim.py)."""

    def __init__(
        self,
        conn: Connection,
        engine: EngineLike,
        relay: RelaySink,
        trim_heap: Callable[[], None],
    ) -> None:
        self.conn, self.engine, self.relay = conn, engine, relay
        self.trim_heap = trim_heap

    def status(self) -> Status:
        ids = tuple(self.engine.sessions.session_ids())
        return Status(self.engine.stats(), ids, self.relay.take())

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            handled = self._handle(wait_s=0.0 if busy else _IDLE_WAIT_S)
            if engine.has_unfinished():
                outs = engine.step()
                deltas = tuple(CoreOutput(o.request_id, delta_of(o)) for o in outs)
                send(self.conn, StepOut(deltas, self.status()))
                if not engine.has_unfinished():  # the burst's last step, its outputs sent:
                    self.trim_heap()  # what its activations freed goes back to the OS
            else:  # idle: no schedule() sweeps session TTLs, no step refreshes the gauges
                engine.sessions.evict_idle()
                engine.refresh_metrics()
                # NOTE: going idle, after commands (fresh occupancy), or with the gauges just
                # refreshed: the relay never keeps an idle core's updates.
                if handled or busy or self.relay.pending:
                    send(self.conn, StepOut((), self.status()))

    def _handle(self, wait_s: float) -> int:
        """Run every waiting command (waiting up to `wait_s` for the first); how many ran."""
        handled = 0
        while self.conn.poll(wait_s if not handled else 0.0):
            try:
                msg = recv(self.conn)
            except EOFError:  # the replica is gone
                raise _Stop() from None
            self._dispatch(msg)
            handled += 1
        return handled

    def _dispatch(self, msg: Inbound) -> None:
        match msg:
            case Add():
                self._add(msg)
            case Cancel(request_id=rid):
                self.engine.abort_request(rid)
            case Call(call_id=cid, name="health"):
                send(self.conn, Reply(cid, executor_error(self.engine)))
            case Call(call_id=cid, name="flush_prefix_cache"):
                send(self.conn, Reply(cid, self.engine.flush_prefix_cache()))
            case Call(call_id=cid, name="load_lora", args=(name, path)):
                send(self.conn, Reply(cid, update_lora(self.engine, "load", name, path)))
            case Call(call_id=cid, name="unload_lora", args=(name,)):
                send(self.conn, Reply(cid, update_lora(self.engine, "unload", name, "")))
            case CheckGrammar(call_id=cid, spec=spec):
                send(self.conn, Reply(cid, grammar_error(self.engine, spec)))
            case StateCall(call_id=cid, op=op, session_id=sid, data=data):
                send(self.conn, Reply(cid, run_state_op(self.engine, op, sid, data)))
            case Shutdown():
                raise _Stop()

    def _add(self, msg: Add) -> None:
        try:
            extra = request_extras(msg.images, msg.lora_name)
            self.engine.add_request(
                msg.prompt,
                msg.params,
                request_id=msg.request_id,
                session_id=msg.session_id,
                **extra,
            )
        except Exception as exc:  # checked in the replica; a race or a duplicate id
            error = f"{type(exc).__name__}: {exc}"
            final = Delta("", (), None, None, FinishReason.ERROR, len(msg.prompt), 0, error)
            send(self.conn, StepOut((CoreOutput(msg.request_id, final),), self.status()))


def ready(engine: Any, clock: PhaseClock, core: EngineCore, factory: str | None) -> Ready:
    """The `Ready` message: what the replica serves with, and this process's start-up."""
    return Ready(
        int(engine.max_model_len),
        engine.tokenizer if core_sends_tokenizer(factory) else None,
        engine.model_dir,
        getattr(engine, "limits", None),
        tuple(getattr(engine, "stop_ids", ())),
        dict(engine.weight_bytes),
        float(engine.sessions.ttl_s),
        (clock.report("core"), *engine.startup_reports()),
        core.status(),
    )


def run_core(conn: Connection) -> None:
    """The core process's work: its `Start` message, the engine, the loop."""
    import torch

    clock = PhaseClock()
    engine: EngineLike | None = None
    try:
        start: Start = recv(conn)
        args = AppArgs.model_validate(start.args)
        # NOTE: before torch's OpenMP pool starts: its threads inherit this one's niceness.
        set_niceness(args.engine_niceness, "the engine core")
        if start.threads is not None:  # the replica's CPU reservation, decided there
            torch.set_num_threads(start.threads)
        if start.seat is not None:  # tp_size > 1: this process drives the replica's TP workers
            join_cluster(start.seat)
        engine = make_engine(args, start.factory, clock, start.seat)
        relay = RelaySink()
        attach_metrics(engine, relay)
        trim_heap = heap_trimmer()
        trim_heap()  # what loading freed (the tokenizer's build, the checkpoint's header)
        core = EngineCore(conn, engine, relay, trim_heap)
        send(conn, ready(engine, clock, core, start.factory))
        core.run()
    except _Stop:
        pass
    except BaseException as exc:  # a bug, a failed executor, or a failed build: say so, exit
        log.exception("engine core crashed")
        try:
            send(conn, Died(f"engine core crashed: {type(exc).__name__}: {exc}"))
        except OSError:
            pass  # the replica is gone too
    finally:
        if engine is not None:
            engine.shutdown()


if (
    __name__ == "__main__"
):  # `python -m deployments.frontend.engine.engine_core FD` (core_client.CoreEngine)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(message)s")
    run_core(Connection(int(sys.argv[1])))
