"""What the replica and its engine core process say to each other over their pipe.

Small frozen dataclasses, pickled (protocol 5) one per `send_bytes`. Inbound (replica -> core):
requests, aborts and calls that want a reply. Outbound (core -> replica): one `Ready` at start,
then one `StepOut` per engine step (every request's delta of that step, coalesced) or per
batch of commands handled while idle, `Reply` to a call, and `Died` if the loop crashed.
Deltas, not the engine's cumulative outputs, cross: a message does not grow with context.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deployments.frontend.engine.engine_types import CoreOutput
from shortconv.sampling.grammar.spec import GrammarSpec
from shortconv.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shortconv.engine.images import AnyImage
    from shortconv.engine.request_limits import RequestLimits
    from shortconv.engine.stats import EngineStats, StartupReport
    from workers.cluster_seat import ClusterSeat

# NOTE: one metric update the core's recorder made: (op, metric name, labels, value or values).
MetricOp = tuple[str, str, dict[str, str], Any]


# ---- replica -> core ---------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """The first message: the app's args, the injected engine factory, torch's threads
    (None: torch's default), and with tp_size > 1 the replica's cluster and placement group,
    which the core joins to drive the TP workers (None: the model runs in the core)."""

    args: dict[str, Any]
    factory: str | None
    threads: int | None
    seat: ClusterSeat | None = None


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    session_id: str | None
    images: tuple[AnyImage, ...] = ()
    lora_name: str | None = None


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Call:
    """A call answered by `Reply(call_id, ...)`: "health" (the executor's error or None),
    "flush_prefix_cache" (entries dropped), "load_lora" (`args` name, path) or "unload_lora"
    (`args` name): the refusal's message or None."""

    call_id: int
    name: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckGrammar:
    """Compile `spec` where the engine compiles grammars (cached there for the request that
    follows), answered by `Reply(call_id, ...)`: why it does not compile, or None. NOTE: the
    replica cannot compile it itself without importing torch (xgrammar imports it)."""

    call_id: int
    spec: GrammarSpec


@dataclass(frozen=True)
class StateCall:
    """A session state operation (deployments/frontend/engine/state_ops.py), answered by
    `Reply(call_id, ...)` with its result."""

    call_id: int
    op: str
    session_id: str
    data: bytes | None = None


@dataclass(frozen=True)
class Shutdown:
    pass


Inbound = Start | Add | Cancel | Call | CheckGrammar | StateCall | Shutdown


# ---- core -> replica ---------------------------------------------------------------------
@dataclass(frozen=True)
class Status:
    """The engine's occupancy and held sessions after the step, and its metric updates."""

    stats: EngineStats
    session_ids: tuple[str, ...]
    metric_ops: tuple[MetricOp, ...]


@dataclass(frozen=True)
class StepOut:
    outputs: tuple[CoreOutput, ...]
    status: Status


@dataclass(frozen=True)
class Ready:
    """The engine is built: what the replica needs to serve in front of it."""

    max_model_len: int
    tokenizer: Any  # None: the replica loads its own (frontend/engine/core_tokenizer.py)
    model_dir: Path
    limits: RequestLimits | None  # None: an injected engine with no limits (checked in core)
    stop_ids: tuple[int, ...]
    weight_bytes: dict[str, int]
    session_ttl_s: float
    reports: tuple[StartupReport, ...]  # the core's own, then its TP ranks'
    status: Status


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any


@dataclass(frozen=True)
class Died:
    """The core's loop crashed (or never started); it exits after sending this."""

    error: str


Outbound = StepOut | Ready | Reply | Died


def send(conn: Connection, msg: Inbound | Outbound) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=5))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())
