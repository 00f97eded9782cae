"""How many CPUs Ray reserves for a replica and for each of its TP workers.

The engine's torch threads follow these reservations (workers/cpu_threads.py), so they are the
compute a replica gets. `replica_num_cpus: all` (the shipped YAMLs) gives one replica the whole
node: every CPU of the largest Ray node but the ingress's share; with tp_size > 1 the replica
keeps DRIVER_CPUS for its engine loop and the ranks split the rest. A number reserves exactly
that for the replica and DEFAULT_WORKER_CPUS per rank, as before.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

INGRESS_NUM_CPUS = 0.1  # it parses JSON and relays chunks; the model's CPUs stay the model's
DRIVER_CPUS = 0.5  # a tp_size > 1 replica schedules and detokenizes; its ranks compute


@dataclass(frozen=True)
class CpuPlan:
    replica: float
    per_worker: float  # meaningful only with tp_size > 1


def node_cpus() -> float:
    """The CPUs of the largest alive Ray node (the node one replica would fill); this process's
    own CPUs when Ray is not up or no node offers any yet (a cluster whose workers are still
    starting)."""
    import ray

    if ray.is_initialized():
        sizes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        if max(sizes, default=0.0) > 0:
            return float(max(sizes))
    return float(len(os.sched_getaffinity(0)))


def _floor_tenth(x: float) -> float:
    return math.floor(x * 10 + 1e-9) / 10  # Ray's resource arithmetic is exact in tenths


def cpu_plan(replica_num_cpus: float | str, tp_size: int, node: float | None = None) -> CpuPlan:
    """The reservations for one replica; `node` defaults to node_cpus()."""
    from workers.ray_executor import DEFAULT_WORKER_CPUS

    if replica_num_cpus != "all":
        return CpuPlan(float(replica_num_cpus), DEFAULT_WORKER_CPUS)
    free = (node_cpus() if node is None else node) - INGRESS_NUM_CPUS
    if tp_size == 1:
        return CpuPlan(max(_floor_tenth(free), 0.1), DEFAULT_WORKER_CPUS)
    per_worker = _floor_tenth((free - DRIVER_CPUS) / tp_size)
    return CpuPlan(DRIVER_CPUS, max(per_worker, 0.1))
