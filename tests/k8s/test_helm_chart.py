"""The Helm chart (k8s/shortconv), rendered offline with Helm's Go SDK and validated like an API
server would: built-in kinds strictly for Kubernetes 1.30, the RayService and PodMonitor against
their upstream CRDs, serveConfigV2 against Ray Serve's own schema and against deployments/*.yaml.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) is not installed")
pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")

import helm_python as helm  # noqa: E402
import helm_utils as hu  # noqa: E402

DEPLOYMENTS = hu.REPO_ROOT / "deployments"
DASHBOARD = hu.REPO_ROOT / "k8s" / "grafana" / "shortconv-dashboard.json"
ENGINE_METRICS = (
    "state_slots_used state_slots_total graph_replay_failures_total num_requests_running "
    "num_requests_waiting time_to_first_token_seconds_bucket inter_token_latency_seconds_bucket "
    "session_cache_hits_total session_cache_misses_total"
).split()


# ---- lint and validation ------------------------------------------------------------------------


@pytest.mark.parametrize("values_file", [None, "ci/cpu-values.yaml", "examples/zaya1-8b-tp2.yaml"])
def test_lint_reports_no_errors(values_file: str | None) -> None:
    values = hu.load_values_file(values_file) if values_file else None
    report = helm.lint(hu.CHART_DIR, values, kube_version=f"v{hu.KUBE_VERSION}", strict=True)
    # Severity 3 is an error; strict mode also turns warnings (2) into failures.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("case", hu.CASES)
def test_builtin_kinds_validate_strictly(case: str) -> None:
    builtins = [d for d in hu.rendered(case) if not hu.is_custom_resource(d)]
    for doc in builtins:
        hu.validate_builtin(doc)
    kinds = {d["kind"] for d in builtins}
    assert kinds <= {"Service", "ConfigMap", "PodDisruptionBudget", "PersistentVolumeClaim"}


@pytest.mark.parametrize("case", hu.CASES)
def test_custom_resources_validate_against_crds(case: str) -> None:
    if not hu.SCHEMAS_DIR.is_dir():
        pytest.skip(f"CRD schemas not found at {hu.SCHEMAS_DIR} (shared/schemas next to the clone)")
    customs = [d for d in hu.rendered(case) if hu.is_custom_resource(d)]
    assert any(d["kind"] == "RayService" for d in customs)
    for doc in customs:
        assert hu.validate_custom(doc) == [], f"{doc['kind']} is invalid"


def test_validators_reject_unknown_and_missing_fields() -> None:
    """Both validators must catch what strict field validation on an API server catches."""
    svc = hu.one(hu.rendered("default"), "Service")
    svc["spec"]["selectors"] = svc["spec"].pop("selector")
    with pytest.raises(Exception, match="selectors"):
        hu.validate_builtin(svc)
    if not hu.SCHEMAS_DIR.is_dir():
        pytest.skip(f"CRD schemas not found at {hu.SCHEMAS_DIR} (shared/schemas next to the clone)")

    def rayservice() -> dict[str, Any]:
        return hu.one(hu.rendered("default"), "RayService")

    typo = rayservice()
    typo["spec"]["serveConfigv2"] = typo["spec"].pop("serveConfigV2")
    assert any("serveConfigv2" in e for e in hu.validate_custom(typo))
    nested = rayservice()
    nested["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["bogus"] = 1
    assert any("bogus" in e for e in hu.validate_custom(nested))
    headless = rayservice()
    del headless["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert any("headGroupSpec" in e for e in hu.validate_custom(headless))


# ---- what the resources say ---------------------------------------------------------------------


def _cluster(case: str) -> dict[str, Any]:
    return hu.one(hu.rendered(case), "RayService")["spec"]["rayClusterConfig"]


@pytest.mark.parametrize("case", hu.CASES)
def test_worker_group_holds_one_replica_per_pod(case: str) -> None:
    cluster, vals = _cluster(case), hu.effective(case)
    args, workers = vals["serve"]["args"], vals["workers"]
    assert cluster["enableInTreeAutoscaling"] is vals["autoscaler"]["enabled"]
    # Replicas and TP workers never land on the head.
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in json.dumps(cluster["headGroupSpec"])
    (group,) = cluster["workerGroupSpecs"]
    lo = args["min_replicas"] if workers.get("minReplicas") is None else workers["minReplicas"]
    hi = args["max_replicas"] if workers.get("maxReplicas") is None else workers["maxReplicas"]
    assert (group["minReplicas"], group["maxReplicas"]) == (lo, hi)
    (worker,) = group["template"]["spec"]["containers"]
    gpus = args["tp_size"] if args["device"] == "cuda" else None
    # One replica's whole TP placement group fits in one worker pod.
    assert worker["resources"]["limits"].get("nvidia.com/gpu") == gpus
    assert worker["resources"]["requests"].get("nvidia.com/gpu") == gpus
    assert group["groupName"] == ("gpu-workers" if gpus else "cpu-workers")


@pytest.mark.parametrize("case", hu.CASES)
def test_model_volume_follows_values(case: str) -> None:
    cluster, vals = _cluster(case), hu.effective(case)
    args, volume = vals["serve"]["args"], vals["model"]["volume"]
    repo_id = vals["model"]["download"].get("repoId")
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        model_vols = [v for v in pod.get("volumes", []) if v["name"] == "model"]
        assert len(model_vols) == (volume["type"] != "none")
        for vol in model_vols:
            if volume["type"] == "pvc":
                claim = volume["pvc"]["existingClaim"] or "shortconv-model"
                assert vol["persistentVolumeClaim"]["claimName"] == claim
            else:
                assert vol["hostPath"]["path"] == volume["hostPath"]["path"]
            mounts = [
                m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == "model"
            ]
            assert mounts and all(m["mountPath"] == volume["mountPath"] for m in mounts)
        inits = pod.get("initContainers", [])
        assert bool(inits) == bool(repo_id)
        if inits:
            # Downloads to the directory the app will load: `model`, under `model_root`.
            model_dir = str(Path(args.get("model_root") or "/") / args["model"])
            assert inits[0]["args"][1:3] == [model_dir, repo_id]


@pytest.mark.parametrize("case", hu.CASES)
def test_optional_resources_follow_values(case: str) -> None:
    docs, vals = hu.rendered(case), hu.effective(case)
    volume = vals["model"]["volume"]
    expected_kinds = {
        "PodMonitor": vals["monitoring"]["podMonitor"]["enabled"],
        "ConfigMap": vals["monitoring"]["dashboard"]["enabled"],
        "PodDisruptionBudget": vals["podDisruptionBudget"]["enabled"],
        "Service": vals["service"]["enabled"],
        "PersistentVolumeClaim": volume["type"] == "pvc" and volume["pvc"]["create"],
    }
    for kind, present in expected_kinds.items():
        assert len(hu.by_kind(docs, kind)) == int(bool(present)), kind


@pytest.mark.parametrize("case", hu.CASES)
def test_every_pod_exports_metrics_and_reads_the_session_header(case: str) -> None:
    docs, vals = hu.rendered(case), hu.effective(case)
    rs = hu.one(docs, "RayService")
    port = vals["metrics"]["port"]
    cluster = rs["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert group["rayStartParams"]["metrics-export-port"] == str(port)
    for container in hu.ray_containers(rs):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RAY_SERVE_SESSION_ID_HEADER_KEY"] == vals["session"]["headerKey"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == port
        assert ports["serve"] == vals["service"]["port"]
    for monitor in hu.by_kind(docs, "PodMonitor"):
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["port"] == "metrics"
        pod_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    for svc in hu.by_kind(docs, "Service"):
        (svc_port,) = svc["spec"]["ports"]
        assert svc_port["targetPort"] == "serve"
        assert svc_port["port"] == vals["service"]["port"]
        assert svc["spec"]["selector"]["ray.io/serve"] == "true"


@pytest.mark.parametrize("case", ["api-key-secret", "default"])
def test_api_key_comes_from_the_secret_in_every_ray_container(case: str) -> None:
    secret = hu.effective(case)["apiKey"]
    for container in hu.ray_containers(hu.one(hu.rendered(case), "RayService")):
        env = {e["name"]: e for e in container["env"]}
        if not secret["existingSecret"]:
            assert "SHORTCONV_API_KEY" not in env
            continue
        assert "value" not in env["SHORTCONV_API_KEY"]  # never the key itself in the manifest
        ref = env["SHORTCONV_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["existingSecret"], "key": secret["secretKey"]}


# ---- serveConfigV2: one source of truth with deployments/*.yaml ---------------------------------


@pytest.mark.parametrize("case", hu.CASES)
def test_serve_config_is_a_valid_serve_config(case: str) -> None:
    config = hu.serve_config(hu.rendered(case))
    vals = hu.effective(case)
    (app,) = config["applications"]
    assert hu.drop_nulls(app["args"]) == hu.drop_nulls(vals["serve"]["args"])
    overrides = vals["serve"].get("deployment")
    # The Serve options are derived from the args; an entry appears only to override some.
    assert app.get("deployments") == ([{"name": "LLMServer", **overrides}] if overrides else None)
    assert config["http_options"] == {"host": "0.0.0.0", "port": vals["service"]["port"]}
    hu.validate_with_ray(config)


def test_chart_defaults_are_zaya1_yaml() -> None:
    """A bare install serves exactly what `serve run deployments/zaya1.yaml` serves."""
    expected = yaml.safe_load((DEPLOYMENTS / "zaya1.yaml").read_text())
    rendered_config = hu.serve_config(hu.rendered("default"))
    assert hu.drop_nulls(rendered_config["applications"]) == hu.drop_nulls(expected["applications"])
    assert rendered_config["proxy_location"] == expected["proxy_location"]


@pytest.mark.parametrize("serve_yaml", sorted(p.name for p in DEPLOYMENTS.glob("*.yaml")))
def test_values_from_serve_yaml_reproduce_it(serve_yaml: str) -> None:
    path = DEPLOYMENTS / serve_yaml
    expected = yaml.safe_load(path.read_text())
    config = hu.serve_config(hu.render(hu.values_from_serve_yaml(path)))
    assert hu.drop_nulls(config["applications"]) == hu.drop_nulls(expected["applications"])
    hu.validate_with_ray(config)


def test_values_schema_mirrors_app_args() -> None:
    """values.schema.json's serve.args must accept exactly AppArgs' fields, with its bounds."""
    from deployments.frontend.config.args import AppArgs

    app_schema = AppArgs.model_json_schema()["properties"]
    chart_schema = hu.chart().schema["properties"]["serve"]["properties"]["args"]["properties"]
    assert set(chart_schema) == set(app_schema), "update values.schema.json serve.args"
    for name, field in app_schema.items():
        ours = chart_schema[name]
        # An optional field (`int | None`) carries its bounds on the non-null branch.
        branches = [b for b in field.get("anyOf", [field]) if b.get("type") != "null"]
        field = branches[0] if len(branches) == 1 else field
        for key in ("enum", "minimum", "exclusiveMinimum", "maximum"):
            assert ours.get(key) == field.get(key), f"serve.args.{name}: {key} differs"


# ---- refused values -----------------------------------------------------------------------------

_REPO = {"repoId": "org/m"}
BAD_VALUES = {
    "tp_size-0": ({"serve": {"args": {"tp_size": 0}}}, ["/serve/args/tp_size", "minimum"]),
    "serve-min-gt-max": (hu.replicas(3, 2), ["min_replicas (3) must not exceed max_replicas (2)"]),
    "workers-min-gt-max": (
        {"workers": {"minReplicas": 5, "maxReplicas": 1}},
        ["workers: minReplicas (5) must not exceed maxReplicas (1)"],
    ),
    "cuda-without-model": ({"serve": {"args": {"device": "cuda"}}}, ["/serve/args", "'model'"]),
    "typo-in-args": ({"serve": {"args": {"tp-size": 2}}}, ["'tp-size' not allowed"]),
    "unknown-device": ({"serve": {"args": {"device": "rocm"}}}, ["/serve/args/device"]),
    "pvc-without-claim": (hu.volume("pvc"), ["/model/volume/pvc"]),
    "hostpath-without-path": (hu.volume("hostPath"), ["/model/volume/hostPath/path"]),
    "download-without-model": (
        hu.deep_merge(hu.volume("pvc", pvc={"create": True}), {"model": {"download": _REPO}}),
        ["/serve/args"],
    ),
    "deployment-typo": ({"serve": {"deployment": {"max_ongoing_reqs": 3}}}, ["'max_ongoing_reqs'"]),
    "api-key-twice": (
        {"apiKey": {"existingSecret": "s"}, "serve": {"args": {"api_key": "sk-x"}}},
        ["apiKey.existingSecret: unset serve.args.api_key"],
    ),
    "api-key-empty-secret-key": ({"apiKey": {"secretKey": ""}}, ["/apiKey/secretKey"]),
    "images-unknown-key": (
        {"serve": {"args": {"images": {"allow_private": True}}}},
        ["'allow_private' not allowed"],
    ),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_are_refused_with_a_clear_message(case: str) -> None:
    values, needles = BAD_VALUES[case]
    with pytest.raises(helm.HelmError) as err:
        hu.render(values)
    message = str(err.value)
    for needle in needles:
        assert needle in message, message


# ---- dashboard, image -------------------------------------------------------------------------


def test_dashboard_panels_cover_the_engine_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    missing = [m for m in ENGINE_METRICS if f"ray_shortconv_{m}" not in exprs]
    assert not missing
    assert "by (pool)" in exprs
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs


def test_chart_embeds_the_one_dashboard_file() -> None:
    in_chart = hu.CHART_DIR / "dashboards" / "shortconv-dashboard.json"
    # A link, not a copy: the dashboard has one source.
    assert in_chart.is_symlink() and in_chart.resolve() == DASHBOARD.resolve()
    (cm,) = hu.by_kind(hu.rendered("default"), "ConfigMap")
    assert cm["data"]["shortconv-dashboard.json"] == DASHBOARD.read_text().rstrip("\n")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_packaged_chart_carries_the_dashboard(tmp_path: Path) -> None:
    """`helm package` resolves the link, so a chart installed from its archive has the file."""
    archive = helm.package(hu.CHART_DIR, destination=tmp_path)
    with helm.Chart.load(archive) as packaged:
        out = packaged.render({}, name="shortconv", namespace="llm")
    (cm,) = [
        d for d in yaml.safe_load_all(out["shortconv/templates/dashboard-configmap.yaml"]) if d
    ]
    assert json.loads(cm["data"]["shortconv-dashboard.json"]) == json.loads(DASHBOARD.read_text())


def test_versions_agree_across_image_chart_and_project() -> None:
    pyproject = (hu.REPO_ROOT / "pyproject.toml").read_text()
    (ray_pin,) = re.findall(r'"ray\[serve\]==([\d.]+)"', pyproject)
    (project_version,) = re.findall(r'^version = "([^"]+)"', pyproject, flags=re.M)
    dockerfile = (hu.REPO_ROOT / "Dockerfile").read_text()
    assert f"ARG RAY_VERSION={ray_pin}" in dockerfile
    assert "FROM rayproject/ray:${RAY_VERSION}-py311-${VARIANT}" in dockerfile
    (torch_pin,) = re.findall(r"torch==([\d.]+)", (hu.REPO_ROOT / "Makefile").read_text())
    assert f"ARG TORCH_VERSION={torch_pin}" in dockerfile
    assert hu.chart().metadata["appVersion"] == project_version
    assert hu.chart().values["rayVersion"] == ray_pin
