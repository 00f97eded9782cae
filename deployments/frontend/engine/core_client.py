"""CoreEngine: the replica's handle on its engine core process, shaped as an `EngineLike`, so
AsyncEngine's loop thread drives it as it drives an in-process engine.

`step()` waits for the core's next coalesced `StepOut` (or for a command to send: AsyncEngine
calls `wake()` when it queues one), and returns its `CoreOutput`s. Requests are checked here
with the engine's own `RequestLimits` before they cross; a grammar is compiled by the core
(`grammar_error`), so this process never imports torch. The core's death (its process exits,
its pipe closes, or it sends `Died`) raises EngineDead: every in-flight stream ends with an
error at once and the health check fails from then on.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deployments.frontend.config.args import AppArgs
from deployments.frontend.engine.core_messages import (
    Add,
    Call,
    Cancel,
    CheckGrammar,
    Died,
    MetricOp,
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
from deployments.frontend.engine.core_tokenizer import TokenizerPreload, core_sends_tokenizer
from deployments.frontend.engine.engine_types import CoreOutput, EngineDead
from deployments.frontend.engine.metrics_relay import replay
from shortconv.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shortconv.engine.images import AnyImage, ImageSpec
    from shortconv.engine.stats import EngineStats, GraphStats, StartupReport
    from shortconv.metrics.recorder import BaseMetricsSink, MetricsRecorder
    from shortconv.sampling.grammar.spec import GrammarSpec
    from workers.cluster_seat import ClusterSeat

log = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0  # a call the core does not answer this long: the core is wedged
_STEP_WAIT_S = 0.5  # step() returns empty after this long with nothing to report


class _Sessions:
    """The core's held sessions as of its last message; it expires them itself. `drop`
    forwards to the core (bound once, by CoreEngine)."""

    def __init__(self, ttl_s: float, drop: Callable[[str], None]) -> None:
        self.ttl_s = ttl_s
        self.ids: tuple[str, ...] = ()
        self.drop = drop

    def evict_idle(self) -> int:
        return 0

    def session_ids(self) -> list[str]:
        return list(self.ids)


class CoreEngine:
    """An engine running in a child process (see the module docstring). Start: `CoreEngine.
    spawn(args, factory, threads)`; blocks until the core is ready or raises if it died."""

    metrics: MetricsRecorder | None = None  # NOTE: the core records; see `relay_metrics_to`

    def __init__(
        self,
        conn: Connection,
        proc: subprocess.Popen[bytes],
        wake: tuple[int, int],
        tokenizer: TokenizerPreload | None = None,
    ) -> None:
        self._conn, self._proc = conn, proc
        self._wake_r, self._wake_w = wake
        self._calls = itertools.count()
        self._replies: dict[int, Any] = {}
        self._pending: list[CoreOutput] = []
        self._live: dict[str, int] = {}  # request id -> forks not finished (loop thread)
        self._sink: BaseMetricsSink | None = None
        self._dead: str | None = None
        self._first_ops: tuple[MetricOp, ...] = ()  # kept until a sink is given
        ready = self._ready()
        if tokenizer is not None:  # NOTE: not sent: loaded here meanwhile (core_tokenizer.py)
            ready = dataclasses.replace(ready, tokenizer=tokenizer.result())
        self.max_model_len, self.tokenizer = ready.max_model_len, ready.tokenizer
        self.model_dir: Path = ready.model_dir
        self.limits = ready.limits
        self.image_spec: ImageSpec | None = ready.limits.image_spec if ready.limits else None
        self.weight_bytes = ready.weight_bytes
        self.core_report, *self.rank_reports = ready.reports
        self._sessions = _Sessions(ready.session_ttl_s, self._drop_session)
        self._status = ready.status
        self._absorb(ready.status)

    @classmethod
    def spawn(
        cls,
        args: dict[str, Any],
        factory: str | None,
        threads: int | None,
        seat: ClusterSeat | None = None,
    ) -> CoreEngine:
        """`launch`, then wait for the core to be ready."""
        return cls.launch(args, factory, threads, seat)()

    @classmethod
    def launch(
        cls,
        args: dict[str, Any],
        factory: str | None,
        threads: int | None,
        seat: ClusterSeat | None = None,
    ) -> Callable[[], CoreEngine]:
        """Start the core now; the returned call waits until it is ready. A fresh interpreter
        (`python -m deployments.frontend.engine.engine_core`), like multiprocessing's
        spawn but without re-running this process's main module (a Ray worker's, pytest's):
        its end of the pipe is passed as an inherited fd, its start arguments as the first
        message. `seat` (tp_size > 1): the replica's cluster and placement group, where the
        core puts the TP workers it drives. NOTE: never fork a process that holds Ray's
        threads."""
        ours, theirs = mp.Pipe(duplex=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        # NOTE: OpenMP's spinning wait made the core's 2-thread decode step 10x slower on a
        # loaded 2-core machine (docs/serving_path.md); a sleeping wait, unless the user chose.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        cmd = [
            sys.executable,
            "-m",
            "deployments.frontend.engine.engine_core",
            str(theirs.fileno()),
        ]
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env)
        theirs.close()  # NOTE: so the core's exit reads as EOF here
        send(ours, Start(args, factory, threads, seat))
        wake = os.pipe()
        os.set_blocking(wake[0], False)
        preload = None
        if not core_sends_tokenizer(factory):
            preload = TokenizerPreload(AppArgs.model_validate(args))
        return functools.partial(cls, ours, proc, wake, preload)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _ready(self) -> Ready:
        while True:
            msg = self._next(None)
            if isinstance(msg, Ready):
                return msg
            if msg is None:
                raise EngineDead(self._dead or "the engine core exited before it was ready")

    # ---- requests (AsyncEngine's loop thread) ---------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine's request limits; a grammar is the core's to check (`grammar_error`)."""
        if self.limits is not None:
            self.limits.validate(prompt_token_ids, params)

    def grammar_error(self, spec: GrammarSpec) -> str | None:
        """Why the core cannot compile `spec`, or None (a round trip; the loop thread's).
        NOTE: the core compiles it, not this process: xgrammar imports torch."""
        cid = next(self._calls)
        self._send(CheckGrammar(cid, spec))
        return self._reply_to(cid, "check_grammar")

    def place_images(
        self, prompt_token_ids: list[int], images: Sequence[AnyImage], n: int = 1
    ) -> Any:
        return self.limits.place_images(prompt_token_ids, images, n) if self.limits else ()

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
        images: Sequence[AnyImage] = (),
        lora_name: str | None = None,
    ) -> str:
        assert request_id is not None, "the replica names every request"
        prompt = list(prompt_token_ids)
        self._send(Add(request_id, prompt, params, session_id, tuple(images), lora_name))
        self._live[request_id] = params.n
        return request_id

    def abort_request(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None and self._dead is None:
            self._send(Cancel(request_id))

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def step(self) -> list[CoreOutput]:
        """The core's next step's outputs (or none after `_STEP_WAIT_S`, or once woken)."""
        if not self._pending:
            self._pump(_STEP_WAIT_S)
        outs, self._pending = self._pending, []
        for out in outs:
            if out.finished and out.request_id in self._live:
                self._live[out.request_id] -= 1
                if not self._live[out.request_id]:
                    del self._live[out.request_id]
        return outs

    def wake(self) -> None:
        """A command is queued: a `step()` waiting on the core returns to send it."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # NOTE: the pipe is full: a wake-up is pending already

    # ---- state and calls -----------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self._status.stats

    def graph_stats(self) -> GraphStats | None:
        return None  # NOTE: the core's recorder reads them where they are

    def refresh_metrics(self) -> None:
        """Take what the core reported meanwhile (idle: nothing steps here)."""
        self._pump(0.0)

    def relay_metrics_to(self, sink: BaseMetricsSink) -> None:
        """Replay the core's metric updates into `sink` from now on (its start-up's first)."""
        self._sink = sink
        replay(sink, self._first_ops)
        self._first_ops = ()

    def flush_prefix_cache(self) -> int:
        return int(self._call("flush_prefix_cache"))

    def load_lora(self, name: str, path: str) -> None:
        self._lora_call("load_lora", name, path)

    def unload_lora(self, name: str) -> None:
        self._lora_call("unload_lora", name)

    def _lora_call(self, call: str, *args: str) -> None:
        """The core's refusal comes back as its message: raised here as the ValueError it was."""
        error = self._call(call, args)
        if error is not None:
            raise ValueError(error)

    def export_session(self, session_id: str) -> bytes | None:
        data = self._state_call("export", session_id)
        return bytes(data) if data is not None else None

    def import_session(self, session_id: str, bundle: bytes) -> bool:
        return bool(self._state_call("import", session_id, bundle))

    def _drop_session(self, session_id: str) -> None:
        self._state_call("drop", session_id)

    def check_health(self) -> None:
        error = self._call("health")
        if error is not None:
            raise EngineDead(error)

    @property
    def sessions(self) -> _Sessions:
        return self._sessions

    def startup_reports(self) -> list[StartupReport]:
        """The core's TP ranks' reports (none at tp_size=1); its own is `core_report`."""
        return list(self.rank_reports)

    def shutdown(self) -> None:
        if self._proc.poll() is None:
            try:
                self._send(Shutdown())
                self._proc.wait(timeout=30.0)
            except (EngineDead, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._conn.close()

    # ---- the pipe --------------------------------------------------------------------------
    def _send(self, msg: Add | Cancel | Call | CheckGrammar | StateCall | Shutdown) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        try:
            send(self._conn, msg)
        except OSError as exc:
            self._die(f"the engine core is gone ({exc})")

    def _call(self, name: str, args: tuple[str, ...] = ()) -> Any:
        cid = next(self._calls)
        self._send(Call(cid, name, args))
        return self._reply_to(cid, name)

    def _state_call(self, op: str, session_id: str, data: bytes | None = None) -> Any:
        cid = next(self._calls)
        self._send(StateCall(cid, op, session_id, data))
        return self._reply_to(cid, f"state {op}")

    def _reply_to(self, cid: int, name: str) -> Any:
        deadline = time.monotonic() + _CALL_TIMEOUT_S
        while cid not in self._replies:
            if time.monotonic() > deadline:
                raise EngineDead(f"the engine core did not answer {name} in {_CALL_TIMEOUT_S}s")
            self._pump(deadline - time.monotonic())
        return self._replies.pop(cid)

    def _pump(self, wait_s: float) -> None:
        """Take every message the core has sent, waiting up to `wait_s` for the first."""
        msg = self._next(wait_s)
        while msg is not None:
            self._take(msg)
            msg = self._next(0.0)

    def _next(self, wait_s: float | None) -> Any:
        """The core's next message, or None when none came in `wait_s` (or a wake-up came).
        Raises EngineDead when the core is gone."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        if not self._conn.poll(0):
            # NOTE: the core's death reads as EOF on its pipe (it holds the only other end).
            ready = wait([self._conn, self._wake_r], wait_s)
            if self._wake_r in ready:
                self._drain_wake()
            if self._conn not in ready:
                return None
        try:
            msg = recv(self._conn)
        except (EOFError, OSError):
            self._die(f"the engine core process exited (code {self._exit_code()})")
        if isinstance(msg, Died):
            self._die(msg.error)
        return msg

    def _take(self, msg: StepOut | Reply) -> None:
        if isinstance(msg, Reply):
            self._replies[msg.call_id] = msg.value
            return
        self._pending.extend(msg.outputs)
        self._absorb(msg.status)

    def _absorb(self, status: Status) -> None:
        self._status = status
        self._sessions.ids = status.session_ids
        if self._sink is not None:
            replay(self._sink, status.metric_ops)
        else:  # NOTE: the series' creation (at start-up) must reach the sink first
            self._first_ops += status.metric_ops

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _exit_code(self) -> int | None:
        try:
            return self._proc.wait(timeout=1.0)  # NOTE: its pipe closes just before it is reaped
        except subprocess.TimeoutExpired:
            return None

    def _die(self, why: str) -> None:
        self._dead = why
        raise EngineDead(why)
