"""The chart's disaggregated layout (docs/disaggregation.md): with `serve.args.disaggregation`
it renders a prefill and a decode worker group, each offering a Ray custom resource of its own,
and the app the rendered Serve config builds makes each role's replicas ask for exactly its
group's resource: checked by building the app from the rendered args and placing each
deployment's replica the way Ray would (its custom resources must be offered by the pod)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) is not installed")

import helm_python as helm  # noqa: E402
import helm_utils as hu  # noqa: E402

from deployments.serve.app import build_app, parse_args  # noqa: E402

SPLIT = {"prefill_replicas": 1, "decode_replicas": 2, "prefill_tp_size": 1}
BUILTIN = {"CPU", "GPU", "memory"}


def disagg(**extra: Any) -> dict[str, Any]:
    args = {"disaggregation": SPLIT, "replica_num_cpus": 1.0, "min_replicas": 2}
    return hu.deep_merge({"serve": {"args": {**args, "max_replicas": 2}}}, extra)


LAYOUTS: dict[str, dict[str, Any]] = {
    "cpu": disagg(),
    "cuda-prefill-tp1-decode-tp2": hu.deep_merge(hu.gpu(2), disagg()),
    "ci": hu.load_values_file("ci/disagg-values.yaml"),
}


def groups(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return hu.one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def replica_demand(deployment: Any) -> dict[str, float]:
    """What one replica's node must offer: bundle 0 with TP (Serve places the replica there,
    STRICT_PACK keeps the other ranks beside it), else the actor's options."""
    bundles = deployment._replica_config.placement_group_bundles
    if bundles:
        total: dict[str, float] = {}
        for bundle in bundles:
            for key, amount in bundle.items():
                total[key] = total.get(key, 0.0) + float(amount)
        return total
    opts = deployment.ray_actor_options
    return {"GPU": float(opts.get("num_gpus", 0)), **opts.get("resources", {})}


def servers(values: dict[str, Any]) -> dict[str, Any]:
    """The LLMServer and PrefillServer deployments the rendered Serve config builds."""
    args = hu.serve_config(hu.render(values))["applications"][0]["args"]
    llm = build_app(parse_args(args))._bound_deployment.init_args[0]._bound_deployment
    out = {llm.name: llm}
    if len(llm.init_args) > 2:
        prefill = llm.init_args[2]._bound_deployment
        out[prefill.name] = prefill
    return out


def hosts(group: dict[str, Any], demand: dict[str, float]) -> bool:
    """Whether a pod of `group` can hold a replica with this demand (custom resources and GPUs;
    CPUs are the operator's sizing)."""
    offered = {k: float(v) for k, v in group.get("resources", {}).items()}
    (pod,) = group["template"]["spec"]["containers"]
    offered["GPU"] = float(pod["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
    return all(offered.get(k, 0.0) >= v for k, v in demand.items() if k not in BUILTIN - {"GPU"})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_role_lands_only_on_its_own_worker_group(layout: str) -> None:
    docs = hu.render(LAYOUTS[layout])
    by_name = {g["groupName"]: g for g in groups(docs)}
    assert set(by_name) == {"prefill-workers", "decode-workers"}
    expected = {"PrefillServer": "prefill-workers", "LLMServer": "decode-workers"}
    deployments = servers(LAYOUTS[layout])
    assert set(deployments) == set(expected)
    for name, deployment in deployments.items():
        demand = replica_demand(deployment)
        fits = [g for g, spec in by_name.items() if hosts(spec, demand)]
        assert fits == [expected[name]], f"{name} ({demand}) fits {fits}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_group_runs_its_roles_replica_count(layout: str) -> None:
    values = hu.chart().merge_values(LAYOUTS[layout])
    d = values["serve"]["args"]["disaggregation"]
    for group in groups(hu.render(LAYOUTS[layout])):
        role = group["groupName"].removesuffix("-workers")
        count = d[f"{role}_replicas"]
        assert (group["minReplicas"], group["maxReplicas"], group["replicas"]) == (count,) * 3
        assert group["template"]["metadata"]["labels"]["shortconv/role"] == role


def test_gpus_follow_each_roles_tp_degree() -> None:
    gpus = {
        g["groupName"]: g["template"]["spec"]["containers"][0]["resources"]["limits"]
        for g in groups(hu.render(LAYOUTS["cuda-prefill-tp1-decode-tp2"]))
    }
    assert gpus["prefill-workers"]["nvidia.com/gpu"] == 1
    assert gpus["decode-workers"]["nvidia.com/gpu"] == 2


def test_role_values_merge_over_workers() -> None:
    values = hu.load_values_file("ci/disagg-values.yaml")
    limits = {
        g["groupName"]: g["template"]["spec"]["containers"][0]["resources"]["limits"]
        for g in groups(hu.render(values))
    }
    assert limits["prefill-workers"] == {"cpu": "1", "memory": "3Gi"}  # memory overridden
    assert limits["decode-workers"] == {"cpu": "1", "memory": "2Gi"}  # workers' as they are
    renamed = hu.deep_merge(values, {"disaggregatedWorkers": {"decode": {"replicas": 3}}})
    (_, decode) = groups(hu.render(renamed))
    assert decode["replicas"] == 3


def test_plain_layout_keeps_one_group_without_role_resources() -> None:
    (group,) = groups(hu.render({}))
    assert "resources" not in group
    (llm,) = servers({}).values()
    assert not llm.ray_actor_options.get("resources")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disaggregated_layout_validates_against_the_crd(layout: str) -> None:
    if not hu.SCHEMAS_DIR.is_dir():
        pytest.skip(f"CRD schemas not found at {hu.SCHEMAS_DIR} (see tests/helm_utils.py)")
    assert hu.validate_custom(hu.one(hu.render(LAYOUTS[layout]), "RayService")) == []
    hu.validate_with_ray(hu.serve_config(hu.render(LAYOUTS[layout])))


def test_ci_values_lint() -> None:
    values = hu.load_values_file("ci/disagg-values.yaml")
    report = helm.lint(hu.CHART_DIR, values, kube_version=f"v{hu.KUBE_VERSION}", strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


def test_replica_bounds_other_than_decode_replicas_are_refused_at_render() -> None:
    with pytest.raises(helm.HelmError, match="must equal decode_replicas \\(2\\)"):
        hu.render(disagg(serve={"args": {"max_replicas": 3}}))


@pytest.mark.parametrize(
    "bad",
    [{"prefill_replicas": 0, "decode_replicas": 1}, {"decode_replicas": 1}, {**SPLIT, "x": 1}],
)
def test_malformed_disaggregation_is_refused(bad: dict) -> None:
    with pytest.raises(Exception, match="disaggregation"):
        hu.render({"serve": {"args": {"disaggregation": bad}}})
