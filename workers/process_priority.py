"""The CPU priority a serving process runs at, rather than the one Ray gave its worker.

Ray starts every worker process at nice 15 (`RAY_worker_niceness`), and a process it spawns
inherits that. On a loaded node a nice-15 engine gets a small share of the cores against any
nice-0 process, a load generator included (docs/serving_path.md has the measurement). Linux
niceness is per thread and inherited at thread creation, so this runs first in a process,
before torch starts its OpenMP pool.

Lowering niceness needs CAP_SYS_NICE (root has it; a Kubernetes pod needs it added, or the
chart's `RAY_worker_niceness=0`). Without it the process stays where it is and says so once.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def set_niceness(target: int, who: str) -> int:
    """Move the calling thread (and so every thread it starts later) to nice `target`; returns
    the niceness it runs at afterwards."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    if now == target:
        return now
    try:
        os.setpriority(os.PRIO_PROCESS, 0, target)
    except PermissionError:
        log.warning(
            "%s runs at nice %d: moving it to nice %d needs CAP_SYS_NICE (or start Ray with "
            "RAY_worker_niceness=%d); under CPU contention it gets a smaller share of the cores",
            who,
            now,
            target,
            target,
        )
        return now
    log.info("%s: nice %d -> %d", who, now, target)
    return os.getpriority(os.PRIO_PROCESS, 0)
