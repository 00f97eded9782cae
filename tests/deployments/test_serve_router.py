"""SessionAffinityRouter's choices, the app builder's options and the tiny-checkpoint cache
(no Ray runtime needed: the router runs on stub replicas in a plain event loop)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from deployments.frontend.config import model_source
from deployments.serve.app import (
    ADMISSION_HEADROOM,
    AppArgsError,
    build,
    build_app,
    deployment_options,
    ingress_options,
    parse_args,
)
from deployments.serve.ingress import IngressConfig
from deployments.serve.router import SessionAffinityRouter

DEP = DeploymentID(name="LLMServer", app_name="app")


class StubReplica:
    """The RunningReplica surface the router and Ray's mixins read."""

    def __init__(self, uid: str, sessions: dict[str, float] | None = None) -> None:
        self.replica_id = ReplicaID(uid, DEP)
        self.node_id, self.availability_zone = "node", None
        self.routing_stats = {"sessions": sessions or {}}
        self.max_ongoing_requests = 8
        self.multiplexed_model_ids: set[str] = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def request(session_id: str = "") -> PendingRequest:
    meta = RequestMetadata(request_id="r", internal_request_id="r", session_id=session_id)
    return PendingRequest(args=[], kwargs={}, metadata=meta)


def make_router(replicas: list[StubReplica], **kwargs: Any) -> SessionAffinityRouter:
    router = SessionAffinityRouter(
        deployment_id=DEP,
        handle_source=DeploymentHandleSource.UNKNOWN,
        self_node_id="node",
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**kwargs)
    router.update_replicas(replicas)  # type: ignore[arg-type]
    return router


def ranks(router: SessionAffinityRouter, sid: str) -> list[list[str]]:
    got = asyncio.run(router.choose_replicas(router._replicas_list, request(sid)))
    return [[r.replica_id.unique_id for r in rank] for rank in got]


def run(coro_fn: Any) -> Any:
    return asyncio.run(coro_fn())


def test_reported_owner_first_then_the_rest() -> None:
    async def main() -> None:
        a, b, c = StubReplica("a"), StubReplica("b", {"s1": 10.0}), StubReplica("c")
        router = make_router([a, b, c])
        got = await router.choose_replicas(router._replicas_list, request("s1"))
        assert [r.replica_id.unique_id for r in got[0]] == ["b"]
        assert sorted(r.replica_id.unique_id for r in got[1]) == ["a", "c"]
        # No session, or a session nobody holds: every replica in one rank (least loaded wins).
        for sid in ("", "unknown"):
            got = await router.choose_replicas(router._replicas_list, request(sid))
            assert len(got) == 1 and len(got[0]) == 3

    run(main)


def test_most_recent_claim_wins_and_survives_replica_set_changes() -> None:
    async def main() -> None:
        a, b = StubReplica("a", {"s1": 100.0}), StubReplica("b", {"s1": 200.0})
        router = make_router([a, b])
        assert router.owner_of("s1") is b  # a holds an older turn of s1
        router.on_request_routed(request("s2"), a.replica_id, None)
        assert router.owner_of("s2") is a  # known before any replica reports it
        # Scale-up: a new replica joins; ownership is by replica id, so nothing moves.
        c = StubReplica("c")
        router.update_replicas([a, b, c])  # type: ignore[list-item]
        assert router.owner_of("s1") is b and router.owner_of("s2") is a
        # The owner dies: its sessions go back to least-loaded routing, the others stay.
        router.update_replicas([a, c])  # type: ignore[list-item]
        assert router.owner_of("s1") is a and router.owner_of("s2") is a
        router.update_replicas([c])  # type: ignore[list-item]
        assert router.owner_of("s1") is None and router.owner_of("s2") is None
        assert router.session_table() == {}

    run(main)


def test_spill_when_owner_is_saturated() -> None:
    async def main() -> None:
        a, b = StubReplica("a", {"s1": 1.0}), StubReplica("b")
        router = make_router([a, b], spill_queue_len=4)
        got = await router.choose_replicas(router._replicas_list, request("s1"))
        assert got[0] == [a]
        router.replica_queue_len_cache.update(a.replica_id, 5)
        router.replica_queue_len_cache.update(b.replica_id, 1)
        got = await router.choose_replicas(router._replicas_list, request("s1"))
        assert got == [[b], [a]]  # spilled, owner last

    run(main)


def test_router_kwargs_are_checked() -> None:
    with pytest.raises(ValueError, match="spill_queue_len"):
        make_router([], spill_queue_len=0)


def test_build_refuses_bad_args_with_every_field_named() -> None:
    with pytest.raises(AppArgsError) as exc:
        build({"tp_size": 0, "tiny_arch": "gpt2", "bogus": True})
    msg = str(exc.value)
    assert "tp_size" in msg and "tiny_arch" in msg and "bogus" in msg


def test_options_place_tp_workers_in_the_replica_group() -> None:
    opts = deployment_options(parse_args({"tp_size": 2, "device": "cuda", "replica_num_cpus": 1}))
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["placement_group_bundles"] == [{"CPU": 1.5, "GPU": 1}, {"CPU": 0.5, "GPU": 1}]
    assert opts["ray_actor_options"] == {"num_cpus": 1}  # fits in bundle 0, holds no GPU
    one = deployment_options(parse_args({"device": "cuda"}))
    assert "placement_group_bundles" not in one and one["ray_actor_options"]["num_gpus"] == 1
    assert one["max_ongoing_requests"] == 32 + 32 + ADMISSION_HEADROOM  # the admission limit


def test_serve_options_follow_the_args() -> None:
    """Every size in the Serve options is derived from the args: a YAML that changes
    max_num_seqs or the replica bounds needs no hand-derived deployment option."""
    args = parse_args({"max_num_seqs": 64, "min_replicas": 0, "max_replicas": 5})
    opts = deployment_options(args)
    assert opts["autoscaling_config"] == {
        "min_replicas": 0,
        "max_replicas": 5,
        "target_ongoing_requests": 32,
    }
    assert opts["max_ongoing_requests"] == 64 + 64 + ADMISSION_HEADROOM
    assert opts["max_queued_requests"] == 64 + 64
    assert "num_replicas" not in opts
    # Equal bounds: a fixed count, for both deployments (no scaling policy to run).
    fixed = parse_args({"min_replicas": 2, "max_replicas": 2})
    opts = deployment_options(fixed)
    assert opts["num_replicas"] == 2 and "autoscaling_config" not in opts
    assert ingress_options(parse_args({"max_replicas": 1}))["num_replicas"] == 1
    assert ingress_options(fixed)["autoscaling_config"]["max_replicas"] == 2
    with pytest.raises(
        AppArgsError, match=r"min_replicas \(3\) must not exceed max_replicas \(2\)"
    ):
        parse_args({"min_replicas": 3, "max_replicas": 2})


def test_tiny_cache_is_built_once_and_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    both = threading.Barrier(2, timeout=30)

    def slow_make(arch: str, out: Path, seed: int = 0) -> Path:
        calls.append(seed)
        both.wait()  # both builders are mid-write at once (a loaded machine may start one late)
        (Path(out) / "config.json").write_text(json.dumps({"arch": arch}))
        return Path(out)

    monkeypatch.setattr("shortconv.tiny.checkpoint.make_tiny_checkpoint", slow_make)
    got: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: got.append(model_source.tiny_checkpoint("lfm2", 3, tmp_path))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] == got[1] and (got[0] / "config.json").is_file()
    assert got[0].name.startswith("tiny-lfm2-3-")
    assert [p.name for p in tmp_path.iterdir()] == [got[0].name]  # no temp dirs left behind
    assert model_source.tiny_checkpoint("lfm2", 3, tmp_path) == got[0] and len(calls) == 2


def test_model_root_confines_model(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    args = parse_args({"model": "m", "model_root": str(tmp_path)})
    assert model_source.resolve_model(args) == tmp_path / "m"
    with pytest.raises(ValueError, match="outside model_root"):
        model_source.resolve_model(parse_args({"model": "../x", "model_root": str(tmp_path)}))
    with pytest.raises(ValueError, match="no config.json"):
        model_source.resolve_model(parse_args({"model": str(tmp_path)}))


def test_the_response_store_is_a_deployment_only_where_ingress_replicas_share_it() -> None:
    """One ingress replica keeps stored Responses itself (one Serve replica fewer, with the
    args' limits); an ingress that can scale past one shares one ResponseStore deployment."""
    for max_replicas, shared in ((1, False), (2, True)):
        args = parse_args({"max_replicas": max_replicas, "responses_ttl_s": 12.0})
        ingress = build_app(args)._bound_deployment
        assert ingress.name == "OpenAIIngress"
        _, cfg, *store = ingress.init_args
        assert [s._bound_deployment.name for s in store] == (["ResponseStore"] if shared else [])
        assert (cfg["responses_ttl_s"], cfg["max_stored_responses"]) == (12.0, 10_000)
        assert IngressConfig(**cfg).responses_ttl_s == 12.0  # the local store's limits
