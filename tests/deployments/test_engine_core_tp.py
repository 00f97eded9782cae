"""The engine core process as the TP driver, without Serve: spawned as a replica spawns it, it
joins a running Ray cluster, puts its TP=2 ranks (gloo) in the placement group it is given
(rank r in bundle r, bundle 0 less the replica's share), decodes transformers' greedy tokens,
and, killed by PID mid-stream, ends the stream with an error, fails its health check and takes
its TP workers with it (Ray ends the actors of a driver that exits)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from core_loop import greedy_tokens, kill_mid_stream, run_loop  # noqa: E402
from oracle import assert_matches_oracle, oracle_greedy  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray_env import descendant_pids, private_ray  # noqa: E402
from reliability_helpers import wait_for  # noqa: E402

from deployments.frontend.engine.async_engine import AsyncEngine  # noqa: E402
from deployments.frontend.engine.core_client import CoreEngine  # noqa: E402
from shortconv.tiny.checkpoint import build_hf_model, make_tiny_checkpoint  # noqa: E402
from workers.cluster_seat import ClusterSeat  # noqa: E402

ARCH, SEED = "lfm2", 3
PROMPTS = [[5, 6, 7, 8, 9], [11, 40, 2, 77, 250, 19, 3]]
MAX_NEW = 10
BUNDLES = [{"CPU": 0.75}, {"CPU": 0.5}]  # bundle 0: the "replica" (0.25) and rank 0 (0.5)
REPLICA_CPUS = 0.25
ERROR_WITHIN_S = 10.0  # the stream's error after the kill: at once, with room for a busy host
GONE_WITHIN_S = 60.0  # Ray notices the driver's exit and kills the actors it owned
TP_WORKER = "ray::TPWorker"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = make_tiny_checkpoint(ARCH, tmp_path_factory.mktemp(ARCH), seed=SEED)
    with private_ray("sctpc-", num_cpus=2):
        yield path


@pytest.fixture()
def seat(ckpt: Path) -> Iterator[ClusterSeat]:
    """A replica's seat: this test's cluster and a fresh group shaped like a TP=2 replica's."""
    pg = placement_group(BUNDLES, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=120)
    ctx = ray.get_runtime_context()
    env = dict(ctx.runtime_env)
    yield ClusterSeat(ctx.gcs_address, ctx.namespace, env, pg.id.hex(), REPLICA_CPUS)
    remove_placement_group(pg)


@pytest.fixture()
def core(ckpt: Path, seat: ClusterSeat) -> Iterator[CoreEngine]:
    args = {"model": str(ckpt), "dtype": "float32", "max_num_seqs": 4, "tp_size": 2}
    engine = CoreEngine.spawn(args, None, 1, seat)
    yield engine
    engine.shutdown()


def free_in_bundles(seat: ClusterSeat) -> list[float]:
    """The CPUs left unused in each bundle of the seat's group (Ray drops zeros)."""
    free = ray.available_resources()
    return [free.get(f"CPU_group_{i}_{seat.placement_group_hex}", 0.0) for i in (0, 1)]


def test_the_core_drives_tp2_workers_in_the_given_group(
    core: CoreEngine, seat: ClusterSeat
) -> None:
    async def both(eng: AsyncEngine) -> list[list[int]]:
        return [await greedy_tokens(eng, f"r{i}", p, MAX_NEW) for i, p in enumerate(PROMPTS)]

    assert [r.who.split(" (")[0] for r in core.startup_reports()] == ["TP rank 0", "TP rank 1"]
    assert len(descendant_pids(TP_WORKER)) == 2
    # Rank 0 took bundle 0 less the replica's share, rank 1 all of bundle 1.
    wait_for(lambda: free_in_bundles(seat) == [REPLICA_CPUS, 0.0], 30, "the ranks in the group")
    got = run_loop(core, both)  # NOTE: the loop's shutdown shuts the core down
    hf = build_hf_model(ARCH, seed=SEED).eval()
    for prompt, ours in zip(PROMPTS, got, strict=True):
        assert_matches_oracle(ours, oracle_greedy(hf, prompt, MAX_NEW), f"TP=2 core {prompt}")


def test_a_killed_core_ends_the_stream_fails_health_and_takes_its_workers(
    core: CoreEngine, seat: ClusterSeat
) -> None:
    assert len(descendant_pids(TP_WORKER)) == 2

    last, elapsed = run_loop(core, lambda eng: kill_mid_stream(eng, core.pid, PROMPTS[0]))
    assert last.finish_reason == "error" and "engine core" in last.error
    assert elapsed < ERROR_WITHIN_S
    wait_for(lambda: not descendant_pids(TP_WORKER), GONE_WITHIN_S, "the TP workers to go")
    wait_for(lambda: free_in_bundles(seat) == [0.75, 0.5], 30, "the group's CPUs released")
