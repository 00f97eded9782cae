"""Where a replica's engine core process places its TP workers: the replica's Ray cluster and
placement group, read in the replica and handed to the core in its `Start` message.

Why: the core is a plain child process of the replica's Ray worker, not a Ray worker itself, so
it has no runtime of its own. It joins the replica's cluster as a driver (same GCS, namespace
and runtime env) and puts rank r into bundle r of the replica's group, as the replica did when
the engine ran in it. Being the TP workers' owner, its death takes them with it: Ray kills the
actors of a driver that exits, however it exits.

NOTE: Ray is imported inside the functions: the core at tp_size=1 unpickles `Start` (and so
imports this module) where Ray may not be installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


@dataclass(frozen=True)
class ClusterSeat:
    """The replica's cluster (`gcs_address`, `namespace`, `runtime_env`), its placement group
    (`placement_group_hex`, bundle index = rank) and the CPUs the replica itself holds in
    bundle 0 (`replica_cpus`: rank 0 takes the rest of that bundle)."""

    gcs_address: str
    namespace: str
    runtime_env: dict[str, Any]
    placement_group_hex: str
    replica_cpus: float


def this_replicas_seat() -> ClusterSeat:
    """The seat of the replica this runs in (a Ray actor placed in a placement group)."""
    import ray

    from workers.cpu_threads import reserved_cpus

    ctx = ray.get_runtime_context()
    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError("a tp_size > 1 replica runs in a placement group (deployments/serve)")
    return ClusterSeat(
        gcs_address=ctx.gcs_address,
        namespace=ctx.namespace,
        runtime_env=dict(ctx.runtime_env),
        placement_group_hex=pg.id.hex(),
        replica_cpus=reserved_cpus() or 0.0,
    )


def join_cluster(seat: ClusterSeat) -> None:
    """Connect this process to the replica's cluster as a driver. NOTE: no dashboard, log
    forwarding or runtime of its own: the replica's cluster already has them.

    Why the runtime env goes over whole: it becomes this job's, so the TP workers start in the
    replica's `working_dir` and `py_modules` (already `gcs://` URIs: nothing is uploaded again),
    with its `env_vars`, and in its `pip` virtualenv, which the replica's start created on this
    node and Ray reuses (tests/deployments/test_engine_core_tp_runtime_env.py)."""
    import ray

    ray.init(
        address=seat.gcs_address,
        namespace=seat.namespace,
        runtime_env=seat.runtime_env or None,
        log_to_driver=False,
    )


def executor_options(seat: ClusterSeat) -> dict[str, Any]:
    """RayExecutor's placement options for a core in `seat` (after `join_cluster`)."""
    from ray import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    group: PlacementGroup = PlacementGroup(PlacementGroupID.from_hex(seat.placement_group_hex))
    return {"replica_group": group, "caller_cpus": seat.replica_cpus}
