"""Torch threads follow the CPUs Ray reserved for this process (a replica or a TP worker).

Ray sets OMP_NUM_THREADS to max(1, int(num_cpus)) in every worker it starts, unless the user
set it; a replica reserved 0.5 CPU then computes on one core however many the machine has, and
one reserved 1.9 (all cores but the ingress's share) on one. The reservation is what the
placement promised this process, so it, not the variable, decides the thread count.
"""

from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger(__name__)


def reserved_cpus() -> float | None:
    """The CPUs Ray reserved for this worker process; None outside a Ray task or actor."""
    if not ray.is_initialized():
        return None
    try:
        return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0))
    except AssertionError:  # the driver: Ray reserves nothing for it
        return None


def threads_for(cpus: float) -> int:
    """Whole threads for a CPU reservation: rounded, at least one."""
    return max(1, round(cpus))


def core_threads() -> int | None:
    """The torch threads for an engine core process this replica starts: its reservation's,
    read without importing torch (the replica itself computes nothing). None outside Ray:
    the core keeps torch's default, as `follow_reservation` would."""
    cpus = reserved_cpus()
    return None if cpus is None else threads_for(cpus)


def follow_reservation(who: str) -> int:
    """Set torch's intra-op threads to this process's reserved CPUs and log it; returns the
    thread count in force. Outside Ray (offline `LLM`) torch's own default is kept.

    NOTE: torch keeps the count in a process-wide setting that threads started later (the
    AsyncEngine's loop, a compiled graph's executor) pick up on their first parallel op."""
    import torch  # NOTE: here, so that importing the app (its build task) does not import it

    cpus = reserved_cpus()
    if cpus is None:
        return torch.get_num_threads()
    threads = threads_for(cpus)
    torch.set_num_threads(threads)
    log.info(
        "%s: %g CPUs reserved -> %d torch threads (OMP_NUM_THREADS was %s)",
        who,
        cpus,
        threads,
        os.environ.get("OMP_NUM_THREADS", "unset"),
    )
    return threads
