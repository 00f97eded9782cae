"""AsyncEngine: one thread steps the synchronous LLMEngine; asyncio callers stream its outputs.

Only the loop thread touches the engine: callers submit, abort and ping through a command queue;
results come back through one asyncio queue per request, a step's deltas for all of them in one
`call_soon_threadsafe` per event loop. A request whose
consumer goes away (client disconnect, cancellation) is aborted, freeing its slots and KV pages.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, NamedTuple

from deployments.frontend.engine.admission import Admission, Admissions
from deployments.frontend.engine.engine_commands import (
    Abort,
    AddRequest,
    CheckHealth,
    Command,
    CompileGrammar,
    ResetPrefixCache,
    Stop,
    Stream,
    UpdateLora,
    answer,
    put,
    put_all,
)
from deployments.frontend.engine.engine_types import (
    CoreOutput,
    Delta,
    EngineDead,
    EngineLike,
    delta_of,
    executor_error,
    request_extras,
    update_lora,
)
from deployments.frontend.engine.state_ops import StateOp, StateOpName, run_state_op
from shortconv.engine.outputs import FinishReason, RequestOutput
from shortconv.sampling.grammar.spec import GrammarError, GrammarSpec
from shortconv.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shortconv.engine.images import AnyImage

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long an idle loop waits for a command between sweeps (TTL, gauges)
_STATS_PERIOD_S = 0.1  # the stats snapshot is refreshed at most this often while busy
_HEALTH_TIMEOUT_S = 30.0  # a step that blocks the loop this long makes the replica unhealthy

# Engines whose loop thread runs; stopped at interpreter exit (see `_stop_running_loops`).
_running: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()


@atexit.register
def _stop_running_loops() -> None:
    """NOTE: a daemon loop thread still inside a torch op while the interpreter tears down runs
    under libtorch's static destructors, and the process aborts after its work is done
    ("terminate called without an active exception"). Stop every loop first: the step in
    flight finishes, then the thread returns."""
    for engine in list(_running):
        engine.shutdown()


class _Submitted(NamedTuple):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    images: tuple[AnyImage, ...]
    lora_name: str | None


class AsyncEngine:
    """Runs `engine` on a daemon thread. Start with `start()`, stop with `shutdown()`."""

    def __init__(self, engine: EngineLike, *, admission_limit: int) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}  # NOTE: mutated on the loop thread only
        self._forks_left: dict[str, int] = {}  # a stream's forks not finished yet (loop thread)
        self._admissions = Admissions(admission_limit)  # caller side
        self._session_seen: dict[str, float] = {}
        self._stats: dict[str, Any] = {}
        self._stats_at = 0.0
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="shortconv-engine", daemon=True)
        # An engine in another process waits on its pipe inside step(): woken to send commands.
        self._wake: Callable[[], None] | None = getattr(engine, "wake", None)
        # ... and compiles grammars there (CoreEngine.grammar_error); None: `validate` does.
        self._core_grammar: Callable[[GrammarSpec], str | None] | None = getattr(
            engine, "grammar_error", None
        )

    # ---- caller side (asyncio) ------------------------------------------------------------
    def start(self) -> None:
        self._publish_stats(force=True)
        self._thread.start()
        _running.add(self)

    @property
    def num_admitted(self) -> int:
        """Requests admitted and not yet given back (running, waiting or not yet started)."""
        return self._admissions.count

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        session_id: str | None = None,
        images: Sequence[AnyImage] = (),
        lora_name: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Check the request now, then stream its deltas; the last has `finish_reason` set.
        `images` fill the prompt's image placeholders in order (shortconv/engine/images.py);
        `lora_name` is the LoRA adapter the request runs under (None: the base model).
        With `params.n` > 1 the forks' deltas come interleaved, each with its `index`, until
        every fork has finished (or one failed).

        Raises at once (nothing queued) ValueError for a prompt the engine refuses,
        EngineOverloaded when the replica's queue is full, EngineDead when the loop is gone.
        The request is queued when iteration starts and aborted if iteration stops early.
        """
        if not self.alive:
            raise EngineDead(self._error or "the engine loop is not running")
        self.engine.validate(prompt_token_ids, params)  # read-only: safe off the loop thread
        if images:
            self.engine.place_images(prompt_token_ids, images, params.n)  # read-only too
        # NOTE: given back exactly once: when the stream ends, or when a stream that was never
        # iterated is dropped (its generator's finalizer).
        admitted = self._admissions.admit(params.n)
        prompt = list(prompt_token_ids)
        request = _Submitted(request_id, prompt, params, tuple(images), lora_name)
        deltas = self._stream(request, session_id, admitted)
        weakref.finalize(deltas, admitted.release)
        return deltas

    async def _stream(
        self, request: _Submitted, session_id: str | None, admitted: Admission
    ) -> AsyncIterator[Delta]:
        rid, prompt, params, images, lora_name = request
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue(), session_id)
        self._command(AddRequest(rid, prompt, params, stream, images, lora_name))
        left, failed = params.n, False
        try:
            while left and not failed:
                delta = await stream.queue.get()
                # The backlog as one delta; forks' deltas interleave, so only without forks.
                while params.n == 1 and delta.finish_reason is None and not stream.queue.empty():
                    delta = delta.then(stream.queue.get_nowait())
                left -= delta.finish_reason is not None
                failed = delta.finish_reason == FinishReason.ERROR
                yield delta
        finally:
            admitted.release()
            if left:  # NOTE: a failed fork ends the stream; its siblings are aborted with it
                self._command(Abort(rid))

    async def check_health(self) -> None:
        """Raise when the loop is dead or the executor (TP workers) fails its health check."""
        error = await self._ask(CheckHealth)
        if error is not None:
            raise EngineDead(error)

    async def flush_prefix_cache(self) -> int:
        """Drop the engine's prefix cache on the loop thread; returns the entries dropped."""
        return int(await self._ask(ResetPrefixCache))

    async def update_lora(self, op: str, name: str, path: str = "") -> str | None:
        """Load (`op` "load") or unload a LoRA adapter on the loop thread, between steps; the
        refusal's message, or None. NOTE: a load reads and checks the files there, so it
        holds the steps for as long as that takes (a small adapter: milliseconds)."""
        return await self._ask(functools.partial(UpdateLora, op, name, path))

    async def check_grammar(self, spec: GrammarSpec) -> None:
        """Raise GrammarError when `spec` does not compile. An engine in this process
        compiles it in `generate` (its `validate`); one in a core process compiles it there,
        asked from the loop thread (the pipe's one reader), so this process never imports
        xgrammar, nor torch with it."""
        if self._core_grammar is None:
            return
        error = await self._ask(functools.partial(CompileGrammar, spec))
        if error is not None:
            raise GrammarError(error)

    async def state_op(self, op: StateOpName, session_id: str, data: bytes | None = None) -> Any:
        """Export, import or drop a session's state on the loop thread, between steps
        (deployments/frontend/engine/state_ops.py). NOTE: commands run in order, so an import
        queued before a request's AddRequest is in place when that request is scheduled."""
        return await self._ask(functools.partial(StateOp, op, session_id, data))

    async def _ask(self, command: Callable[[asyncio.Future[Any]], Command]) -> Any:
        """Queue `command(reply)` for the loop thread and await its answer."""
        if not self.alive:
            raise EngineDead(self._error or "the engine loop is not running")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._command(command(fut))
        return await asyncio.wait_for(fut, _HEALTH_TIMEOUT_S)

    def drop_session(self, session_id: str) -> None:
        """Queue the session's kept state to be dropped (its slot and pages freed) without
        waiting: callable from a stream's `finally`, even while its task is cancelled."""
        if self.alive:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._command(StateOp("drop", session_id, None, fut))

    def stats(self) -> dict[str, Any]:
        """The latest snapshot (engine occupancy + held sessions), refreshed by the loop."""
        return self._stats

    def _command(self, cmd: Command) -> None:
        self._cmds.put(cmd)
        if self._wake is not None:
            self._wake()

    def shutdown(self) -> None:
        _running.discard(self)
        if self._thread.is_alive():
            self._command(Stop())
            self._thread.join(timeout=30.0)
        self.engine.shutdown()

    # ---- loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                handled = self._handle_commands(block=not self.engine.has_unfinished())
                if handled < 0:
                    return
                if self.engine.has_unfinished():
                    self._deliver_step(self.engine.step())
                else:  # idle: no schedule() sweeps session TTLs, no step refreshes the gauges
                    self.engine.sessions.evict_idle()
                    self.engine.refresh_metrics()
                # NOTE: fresh after any submit/abort and on going idle, so occupancy read right
                # after a request starts or ends (tests, dashboards) is never stale. An engine
                # in another process sends its status with every step, a step after a submit
                # reaches it: publish each (it costs the engine nothing).
                idle = not self.engine.has_unfinished()
                self._publish_stats(force=handled > 0 or idle or self._wake is not None)
        except Exception as exc:  # a bug in the engine, or a failed executor: fail all, stay dead
            log.exception("engine loop crashed")
            dead = isinstance(exc, EngineDead)
            self._error = str(exc) if dead else f"engine loop crashed: {type(exc).__name__}: {exc}"
            self._fail_all(self._error)
            # NOTE: keep answering commands (adds and health checks get the error), so a request
            # submitted just as the engine died is answered instead of waiting forever.
            while self._handle_commands(block=True) >= 0:
                pass

    def _handle_commands(self, block: bool) -> int:
        """Run queued commands; returns how many ran, or -1 on stop."""
        try:
            cmd = self._cmds.get(timeout=_IDLE_WAIT_S) if block else self._cmds.get_nowait()
        except queue.Empty:
            return 0
        handled = 0
        while self._dispatch(cmd):
            handled += 1
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return handled
        return -1

    def _dispatch(self, cmd: Command) -> bool:
        """Run one command on the loop thread; False for Stop."""
        match cmd:
            case AddRequest():
                self._add(cmd)
            case Abort(request_id=rid):
                self._forks_left.pop(rid, None)
                if self._streams.pop(rid, None) is not None:
                    self.engine.abort_request(rid)
            case CheckHealth(reply=fut):
                answer(fut, self._error or executor_error(self.engine))
            case ResetPrefixCache(reply=fut):
                answer(fut, self.engine.flush_prefix_cache())
            case UpdateLora(op=op, name=name, path=path, reply=fut):
                answer(fut, update_lora(self.engine, op, name, path))
            case CompileGrammar(spec=spec, reply=fut):
                assert self._core_grammar is not None  # NOTE: only queued for a core's engine
                answer(fut, self._core_grammar(spec))
            case StateOp(op=op, session_id=sid, data=data, reply=fut):
                answer(fut, run_state_op(self.engine, op, sid, data))
            case Stop():
                self._fail_all("the server is shutting down")
                return False
        return True

    def _add(self, cmd: AddRequest) -> None:
        rid, prompt, stream = cmd.request_id, cmd.prompt, cmd.stream
        if self._error is not None:  # submitted just as the engine died
            put(stream, _final(prompt, FinishReason.ERROR, self._error))
            return
        try:
            extra = request_extras(cmd.images, cmd.lora_name)
            self.engine.add_request(
                prompt, cmd.params, request_id=rid, session_id=stream.session_id, **extra
            )
        except Exception as exc:  # validated already; this is a race or a duplicate id
            put(stream, _final(prompt, FinishReason.ERROR, f"{type(exc).__name__}: {exc}"))
            return
        self._streams[rid] = stream
        self._forks_left[rid] = cmd.params.n
        if stream.session_id is not None:
            self._session_seen[stream.session_id] = time.time()

    def _deliver_step(self, outs: Sequence[RequestOutput | CoreOutput]) -> None:
        """Hand one step's deltas over with one wake-up per event loop, not one per stream.

        NOTE: a failed request may mean a failed executor (dead TP rank), which fails every
        request to come: go dead then (503 + failed health check) rather than answer 500s until
        replaced; this step's deltas are handed over first."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Delta]]] = {}
        failed = False
        for out in outs:
            if (stream := self._streams.get(out.request_id)) is None:
                continue
            if out.finished and self._fork_finished(out.request_id):
                del self._streams[out.request_id]
                if stream.session_id is not None:
                    self._session_seen[stream.session_id] = time.time()
            batches.setdefault(stream.loop, []).append((stream, delta_of(out)))
            failed = failed or out.finish_reason == FinishReason.ERROR
        for loop, items in batches.items():
            put_all(loop, items)
        if failed and (why := executor_error(self.engine)) is not None:
            raise EngineDead(why)

    def _fork_finished(self, rid: str) -> bool:
        """Count one finished fork of `rid`; True once all of them have finished."""
        self._forks_left[rid] -= 1
        if self._forks_left[rid]:
            return False
        del self._forks_left[rid]
        return True

    def _fail_all(self, message: str) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # the engine may be the thing that broke
                log.exception("abort of %s failed", rid)
            put(stream, _final([], FinishReason.ERROR, message))
        self._streams.clear()
        self._forks_left.clear()

    def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._stats_at < _STATS_PERIOD_S:
            return
        self._stats_at = now
        snapshot: dict[str, Any] = asdict(self.engine.stats())
        held = {s.session_id for s in self._streams.values() if s.session_id is not None}
        held.update(self.engine.sessions.session_ids())
        for sid in set(self._session_seen) - held:
            del self._session_seen[sid]
        snapshot["sessions"] = {sid: self._session_seen.get(sid, 0.0) for sid in sorted(held)}
        snapshot["num_active_requests"] = len(self._streams)
        self._stats = snapshot  # NOTE: replaced whole, so readers on other threads see one dict


def _final(prompt: list[int], reason: FinishReason, error: str | None) -> Delta:
    return Delta("", (), None, None, reason, len(prompt), 0, error)
