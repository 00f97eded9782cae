"""What Ray reserves per replica and per TP rank (deployments/serve/cpu_plan.py), and so the torch
threads each computes with: `all` fills the node with one replica, a number is taken as is."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.serve.app import deployment_options, parse_args
from deployments.serve.cpu_plan import INGRESS_NUM_CPUS, CpuPlan, cpu_plan
from workers.cpu_threads import threads_for
from workers.ray_executor import DEFAULT_WORKER_CPUS, bundle_cpus

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"


@pytest.mark.parametrize(("node", "threads"), [(2, 2), (4, 4), (16, 16)])
def test_all_gives_one_replica_every_core(node: float, threads: int) -> None:
    plan = cpu_plan("all", 1, node=node)
    assert plan.replica + INGRESS_NUM_CPUS <= node  # it fits beside the ingress
    assert threads_for(plan.replica) == threads


def test_all_with_tp_splits_the_node_between_the_ranks() -> None:
    plan = cpu_plan("all", 2, node=16)
    assert plan == CpuPlan(0.5, 7.7)
    assert plan.replica + 2 * plan.per_worker + INGRESS_NUM_CPUS <= 16
    tiny = cpu_plan("all", 4, node=2)  # never a zero reservation
    assert tiny.per_worker > 0 and threads_for(tiny.per_worker) == 1


def test_a_number_is_reserved_as_given() -> None:
    assert cpu_plan(3, 1) == CpuPlan(3.0, DEFAULT_WORKER_CPUS)
    assert cpu_plan(0.5, 2, node=64) == CpuPlan(0.5, DEFAULT_WORKER_CPUS)


def test_deployment_options_reserve_the_plan() -> None:
    args = parse_args({"tp_size": 2, "replica_num_cpus": "all"})
    opts = deployment_options(args, CpuPlan(0.5, 3.5))
    assert opts["ray_actor_options"] == {"num_cpus": 0.5}
    assert opts["placement_group_bundles"] == [{"CPU": 4.0}, {"CPU": 3.5}]
    one = deployment_options(parse_args({"replica_num_cpus": "all"}), CpuPlan(1.9, 0.5))
    assert one["ray_actor_options"] == {"num_cpus": 1.9}


@pytest.mark.parametrize("path", sorted(DEPLOYMENTS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_yamls_fill_the_machine_with_one_replica(path: Path) -> None:
    (app,) = yaml.safe_load(path.read_text())["applications"]
    args = parse_args(app["args"])
    if args.device == "cpu":
        assert args.replica_num_cpus == "all" and args.max_replicas == 1


def test_ranks_take_their_bundles_less_the_replicas_share() -> None:
    """Inside a replica's group each TP rank reserves its bundle (bundle 0: less the replica)."""
    opts = deployment_options(parse_args({"tp_size": 2}), CpuPlan(0.5, 3.5))
    assert bundle_cpus(opts["placement_group_bundles"], 0.5) == [3.5, 3.5]
    assert bundle_cpus([{"CPU": 0.5}], 1.0) == [0.0]  # never negative
