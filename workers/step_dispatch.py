"""Per-step fan-out of one step message (`StepDelta`) to every TP worker, with bounded waits.

Two Ray mechanisms do the same job; bench/tp_overhead.py measures both:
* `ActorCallDispatch`: a plain actor call per rank per step (`w.execute.remote(delta)`).
* `CompiledGraphDispatch`: a Ray Compiled Graph (`experimental_compile`) that keeps the actors
  in a loop fed through shared-memory channels, skipping per-call task submission.
Either one turns every failure (dead actor, exception in a rank, timeout) into ExecutorError.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from shortconv.engine.executor import ExecutorError
from shortconv.engine.plan import StepResult
from shortconv.engine.step_delta import StepDelta


def describe(exc: BaseException, rank: int | None = None) -> str:
    """A one-line reason for the engine's error message (Ray's own are pages long)."""
    who = f"TP rank {rank}" if rank is not None else "a TP worker"
    if isinstance(exc, RayActorError):
        return f"{who} died ({type(exc).__name__})"
    if isinstance(exc, TimeoutError | GetTimeoutError):
        return f"{who} did not answer in time ({type(exc).__name__})"
    cause = getattr(exc, "cause", None) or exc
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return f"{who} failed: {type(cause).__name__}: {first}"[:500]


def dead_ranks(workers: list[Any], timeout_s: float = 2.0) -> list[int]:
    """Ranks whose actor is known dead (a hung rank is not listed: it may still answer)."""
    refs = [w.ping.remote() for w in workers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    dead = []
    for rank, ref in enumerate(refs):
        if ref in ready:
            try:
                ray.get(ref)
            except RayActorError:
                dead.append(rank)
            except RayError:
                pass
    return dead


def wait_ranks(
    refs: list[Any], timeout_s: float, what: str, passthrough: tuple[type[Exception], ...] = ()
) -> list[Any]:
    """Every rank's result of one call (`refs` in rank order), or ExecutorError naming the
    first rank that died, failed or did not finish `what` within `timeout_s`. A rank's
    exception of a `passthrough` type (a refusal, not a failure) is raised as itself.

    NOTE: one ref at a time, so a dead rank is reported at once even while its peers sit
    blocked in a collective waiting for it (a plain ray.get(refs) would wait on them)."""
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    deadline = time.monotonic() + timeout_s
    pending = refs
    while pending:
        remaining = max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            rank = rank_of[pending[0]]
            raise ExecutorError(f"TP rank {rank} did not finish {what} within {timeout_s:.0f}s")
        try:
            ray.get(ready[0])
        except RayError as exc:
            if isinstance(exc, RayTaskError) and isinstance(exc.cause, passthrough):
                raise type(exc.cause)(str(exc.cause)) from None
            raise ExecutorError(f"{describe(exc, rank_of[ready[0]])} during {what}") from exc
    return ray.get(refs)


class BaseDispatch(ABC):
    def __init__(self, workers: list[Any], timeout_s: float) -> None:
        self.workers, self.timeout_s = workers, timeout_s

    @abstractmethod
    def run(self, delta: StepDelta) -> StepResult | None:
        """Send `delta` to every rank; rank 0's result, or ExecutorError within timeout_s."""

    def close(self) -> None:
        """Release whatever the dispatch holds; the workers belong to the executor."""
        self.workers = []


class ActorCallDispatch(BaseDispatch):
    def run(self, delta: StepDelta) -> StepResult | None:
        refs = [w.execute.remote(delta) for w in self.workers]
        return wait_ranks(refs, self.timeout_s, f"step {delta.step_id}")[0]


class CompiledGraphDispatch(BaseDispatch):
    def __init__(self, workers: list[Any], timeout_s: float) -> None:
        super().__init__(workers, timeout_s)
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as delta_in:
            dag = MultiOutputNode([w.execute.bind(delta_in) for w in workers])
        self._graph: Any = dag.experimental_compile(_submit_timeout=timeout_s)

    def run(self, delta: StepDelta) -> StepResult | None:
        if self._graph is None:
            raise ExecutorError("compiled graph is torn down")
        try:
            refs = self._graph.execute(delta)
            results = ray.get(refs, timeout=self.timeout_s)
        except (RayError, TimeoutError) as exc:
            # The graph reports a closed channel, not which actor went away: ask the ranks.
            dead = dead_ranks(self.workers)
            reason = f"TP rank {dead[0]} died" if dead else describe(exc)
            raise ExecutorError(f"{reason} during step {delta.step_id}") from exc
        return results[0]

    def close(self) -> None:
        super().close()
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.teardown()
            except (RayError, TimeoutError, RuntimeError):
                pass
