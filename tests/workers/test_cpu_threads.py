"""Torch threads follow the CPUs Ray reserved: a replica's (tp_size=1, the engine in-process)
and each TP worker's, whatever Ray put in OMP_NUM_THREADS. Real actors, whole and fractional."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import ray
import torch
from ray_env import private_ray

from workers.cpu_threads import follow_reservation, reserved_cpus, threads_for
from workers.tp_worker import TPWorker

# NOTE: more CPUs than the machine has are fine: Ray only counts reservations.
RAY_CPUS = 6
HERE = Path(__file__).resolve().parent
PATH = os.pathsep.join(map(str, (HERE, HERE.parent, HERE.parents[1])))  # this module, helpers, repo


@pytest.fixture(scope="module")
def ray_runtime():
    with private_ray("scthr-", {"PYTHONPATH": PATH}, num_cpus=RAY_CPUS):
        yield


def test_outside_ray_threads_are_left_alone() -> None:
    before = torch.get_num_threads()
    assert not ray.is_initialized()  # NOTE: runs before the module's runtime starts
    assert reserved_cpus() is None and follow_reservation("offline") == before
    assert torch.get_num_threads() == before


class ReplicaLike:
    """What LLMServer does at tp_size=1 before its engine exists; the engine then steps on a
    thread of its own (AsyncEngine), which must see the same count."""

    def __init__(self) -> None:
        self.set_to = follow_reservation("replica")

    def report(self) -> dict[str, float | int]:
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        return {"reserved": reserved_cpus() or 0.0, "set": self.set_to, "loop": seen[0]}


@pytest.mark.parametrize(("cpus", "threads"), [(0.5, 1), (1.9, 2), (3, 3)])
def test_replica_threads_equal_its_reserved_cpus(ray_runtime, cpus: float, threads: int) -> None:
    actor = ray.remote(num_cpus=cpus)(ReplicaLike).remote()
    try:
        got = ray.get(actor.report.remote(), timeout=60)
    finally:
        ray.kill(actor)
    assert got == {"reserved": cpus, "set": threads, "loop": threads}


@pytest.mark.parametrize(("cpus", "threads"), [(0.5, 1), (2.6, 3)])
def test_tp_worker_threads_equal_its_reserved_cpus(ray_runtime, cpus: float, threads: int) -> None:
    worker = ray.remote(TPWorker).options(num_cpus=cpus).remote(0, 1)
    try:
        assert ray.get(worker.torch_threads.remote(), timeout=60) == threads
    finally:
        ray.kill(worker)


def test_threads_for_rounds_and_never_drops_to_zero() -> None:
    assert [threads_for(c) for c in (0.1, 0.5, 1.0, 1.4, 1.6, 16)] == [1, 1, 1, 1, 2, 16]


class ThreadsOf:
    """The replica's thread choice (`deployments.serve.server.engine_threads`) for given args,
    in an actor with a reservation of its own."""

    def threads(self, args: dict[str, object]) -> tuple[int | None, int]:
        from deployments.frontend.config.args import AppArgs
        from deployments.serve.server import engine_threads

        return engine_threads(AppArgs.model_validate(args)), torch.get_num_threads()


@pytest.mark.parametrize("in_core", [True, False])
def test_torch_threads_overrides_the_reservation(ray_runtime, in_core: bool) -> None:
    actor = ray.remote(num_cpus=0.5)(ThreadsOf).remote()
    try:
        plain = ray.get(actor.threads.remote({"engine_process": in_core}), timeout=60)
        args = {"engine_process": in_core, "torch_threads": 3}
        got = ray.get(actor.threads.remote(args), timeout=60)
    finally:
        ray.kill(actor)
    assert plain[0] == 1  # the reservation's
    assert got[0] == 3
    # NOTE: in a core process the count is the core's to set; the replica computes nothing
    assert got[1] == (plain[1] if in_core else 3)


def test_torch_threads_refused_with_tp() -> None:
    from deployments.frontend.config.args import AppArgs

    with pytest.raises(ValueError, match="torch_threads needs tp_size=1"):
        AppArgs.model_validate({"torch_threads": 2, "tp_size": 2})
