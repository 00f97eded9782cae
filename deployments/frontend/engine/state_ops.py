"""A session's state in and out of a running engine, from the replica's event loop.

Disaggregation (deployments/frontend/openai/handoff.py) exports the state a prefill left
under a session, imports it on a decode replica, and drops a handoff's transient session once
its request is done. These run on the engine's own thread (AsyncEngine's loop, between steps),
or in its core process (`Call("state", ...)`), never beside a step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import asyncio

    from deployments.frontend.engine.engine_types import EngineLike

log = logging.getLogger(__name__)

StateOpName = Literal["export", "import", "drop"]


@dataclass(frozen=True)
class StateOp:
    """`export` (answered with the bundle's bytes, or None when the session keeps nothing),
    `import` (`data`; answered True, or False when the engine refused it), `drop` (None)."""

    op: StateOpName
    session_id: str
    data: bytes | None
    reply: asyncio.Future[Any]


def run_state_op(engine: EngineLike, op: str, session_id: str, data: bytes | None) -> Any:
    """Run one state operation on `engine` (an LLMEngine, or a CoreEngine that forwards it).
    A failure is logged and answered as "nothing moved" (None, or False for an import): the
    caller then prefills instead. NOTE: a broken executor still fails the next step."""
    try:
        return _run(engine, op, session_id, data)
    except Exception:
        log.warning("state %s of session %s failed", op, session_id, exc_info=True)
        return False if op == "import" else None


def _run(engine: EngineLike, op: str, session_id: str, data: bytes | None) -> Any:
    if op == "export":
        return engine.export_session(session_id)
    if op == "import":
        assert data is not None, "an import carries a bundle"
        return engine.import_session(session_id, data)
    if op == "drop":
        engine.sessions.drop(session_id)
        return None
    raise ValueError(f"unknown state operation {op!r}")
