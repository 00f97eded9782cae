"""Offline helpers for the Helm chart tests: render with Helm's Go SDK, validate like an API server.

Rendering uses helm-python-sdk (Helm's own template engine and values-schema check, no helm
binary, no cluster). Built-in kinds are validated with kubernetes-validate's bundled schemas;
custom resources against the upstream CRD files (kuberay v1.7.0, prometheus-operator v0.93.0,
verbatim copies too large to vendor), read from `shared/schemas` next to the clone (CI puts them
there; the tests that need them skip without). The CRD schemas are tightened so that unknown
fields fail the way strict field validation does on a real API server, after nulls are dropped
and defaults filled in as the API server does (`apply_server_defaults`).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART_DIR = REPO_ROOT / "k8s" / "shortconv"
SCHEMAS_DIR = REPO_ROOT.parent / "shared" / "schemas"
KUBE_VERSION = "1.30.0"

# Custom resources the chart renders -> their CRD file under shared/schemas.
_PROM = "prometheus-operator/monitoring.coreos.com_"
CRD_FILES = {
    ("ray.io", "RayService"): "kuberay/ray.io_rayservices.yaml",
    ("monitoring.coreos.com", "PodMonitor"): _PROM + "podmonitors.yaml",
}

_YamlLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache
def chart() -> Any:
    import helm_python as helm

    return helm.Chart.load(CHART_DIR)


def load_values_file(name: str) -> dict[str, Any]:
    """A values file relative to the chart directory."""
    return yaml.safe_load((CHART_DIR / name).read_text())


def render(
    values: dict[str, Any] | None = None, name: str = "shortconv", namespace: str = "llm"
) -> list[dict[str, Any]]:
    """Render the chart (as `helm template`) and return every non-empty manifest document."""
    out = chart().render(values or {}, name=name, namespace=namespace, is_install=True)
    yamls = [out[p] for p in sorted(out) if p.endswith(".yaml")]  # not NOTES.txt
    return [d for text in yamls for d in yaml.load_all(text, Loader=_YamlLoader) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm-style values merge: maps merge key by key, everything else is replaced."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# ---- the values matrix the tests render ----------------------------------------------------------

# A CUDA deployment needs a real checkpoint (values.schema.json): a path on a mounted claim.
_GPU = {
    "serve": {"args": {"model": "/models/ckpt", "device": "cuda", "dtype": "bfloat16"}},
    "model": {"volume": {"type": "pvc", "pvc": {"existingClaim": "weights"}}},
}


def gpu(tp_size: int, **extra: Any) -> dict[str, Any]:
    return deep_merge(deep_merge(_GPU, {"serve": {"args": {"tp_size": tp_size}}}), extra)


def replicas(lo: int, hi: int) -> dict[str, Any]:
    return {"serve": {"args": {"min_replicas": lo, "max_replicas": hi}}}


def volume(kind: str, **spec: Any) -> dict[str, Any]:
    return {"model": {"volume": {"type": kind, **spec}}}


def monitoring(on: bool) -> dict[str, Any]:
    return {"monitoring": {"podMonitor": {"enabled": on}, "dashboard": {"enabled": on}}}


CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "ci-cpu": load_values_file("ci/cpu-values.yaml"),
    "example-zaya1-8b-tp2": load_values_file("examples/zaya1-8b-tp2.yaml"),
    "gpu-tp1": gpu(1),
    "gpu-tp2": gpu(2),
    "gpu-tp4": gpu(4),
    "cpu-tp2": {"serve": {"args": {"tp_size": 2}}},
    "replicas-0-8": replicas(0, 8),
    "replicas-3-3": replicas(3, 3),
    "workers-explicit": gpu(2, workers={"minReplicas": 2, "maxReplicas": 6}),
    "pvc-existing": volume("pvc", pvc={"existingClaim": "weights"}),
    "pvc-create": volume("pvc", pvc={"create": True, "storageClassName": "fast", "size": "40Gi"}),
    "hostpath": gpu(2, **volume("hostPath", hostPath={"path": "/mnt/models"})),
    "hf-download": gpu(
        2,
        **deep_merge(
            volume("pvc", readOnly=False, pvc={"existingClaim": "", "create": True}),
            {"model": {"download": {"repoId": "org/some-model", "tokenSecretName": "hf-token"}}},
        ),
    ),
    "hf-download-model-root": gpu(
        2,
        serve={"args": {"model": "org/some-model", "model_root": "/models"}},
        model={
            "volume": {"type": "hostPath", "readOnly": False, "hostPath": {"path": "/mnt/m"}},
            "download": {"repoId": "org/some-model"},
        },
    ),
    "monitoring-on": deep_merge(
        monitoring(True), {"monitoring": {"podMonitor": {"labels": {"release": "prom"}}}}
    ),
    "monitoring-off": {**monitoring(False), "podDisruptionBudget": {"enabled": False}},
    "service-off": {"service": {"enabled": False}},
    "autoscaler-off": {"autoscaler": {"enabled": False}},
    "api-key-secret": {"apiKey": {"existingSecret": "shortconv-api-key", "secretKey": "key"}},
    "extras": {
        "env": [{"name": "RAY_LOG_LEVEL", "value": "debug"}],
        "imagePullSecrets": [{"name": "regcred"}],
        "service": {"type": "LoadBalancer", "port": 8080, "annotations": {"a": "b"}},
        "metrics": {"port": 9090},
        "head": {"rayStartParams": {"object-store-memory": "1000000000"}},
        "podDisruptionBudget": {"maxUnavailable": "50%"},
    },
}


@functools.cache
def _rendered(case: str) -> str:
    return json.dumps(render(CASES[case]))


def rendered(case: str) -> list[dict[str, Any]]:
    """The case's manifests (rendered once; a fresh copy each call, so tests may edit it)."""
    return json.loads(_rendered(case))


def effective(case: str) -> dict[str, Any]:
    """The values a release would use: Helm's own coalescing of defaults and overrides."""
    return chart().merge_values(CASES[case])


# ---- validation like an API server --------------------------------------------------------------


def is_custom_resource(doc: dict[str, Any]) -> bool:
    return (doc["apiVersion"].split("/")[0], doc["kind"]) in CRD_FILES


def validate_builtin(doc: dict[str, Any]) -> None:
    """Strict (unknown fields rejected) validation of a built-in kind for KUBE_VERSION."""
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def close_schema(node: Any) -> Any:
    """Add additionalProperties: false to every object schema that lists properties, has no
    additionalProperties of its own and does not preserve unknown fields; recurse everywhere a
    subschema can sit. Emulates strict field validation (jsonschema would accept any extra key)."""
    if isinstance(node, list):
        return [close_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if "properties" in out:
        out["properties"] = {k: close_schema(v) for k, v in out["properties"].items()}
        preserve = out.get("x-kubernetes-preserve-unknown-fields") is True
        if "additionalProperties" not in out and not preserve:
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = close_schema(out["additionalProperties"])
    if "items" in out:
        out["items"] = close_schema(out["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = close_schema(out[key])
    return out


def apply_server_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    """What the API server does before validating: drop nulls of non-nullable fields (an empty
    `metadata:` renders as null) and fill in `default`s of missing fields."""
    if isinstance(obj, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out: dict[str, Any] = {}
        for key, value in obj.items():
            sub = props.get(key, extra if isinstance(extra, dict) else {})
            if value is None and not sub.get("nullable"):
                continue
            out[key] = apply_server_defaults(value, sub)
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [apply_server_defaults(item, schema["items"]) for item in obj]
    return obj


@functools.cache
def _crd_schema(group: str, kind: str, version: str) -> dict[str, Any]:
    crd = yaml.load((SCHEMAS_DIR / CRD_FILES[(group, kind)]).read_text(), Loader=_YamlLoader)
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"{group}/{kind}: CRD serves no version {version}")


@functools.cache
def _crd_validator(group: str, kind: str, version: str) -> Any:
    import jsonschema

    return jsonschema.Draft4Validator(close_schema(_crd_schema(group, kind, version)))


def validate_custom(doc: dict[str, Any]) -> list[str]:
    """Errors of a custom resource against its CRD's schema (empty list: valid)."""
    group, version = doc["apiVersion"].split("/")
    schema = _crd_schema(group, doc["kind"], version)
    validator = _crd_validator(group, doc["kind"], version)
    obj = apply_server_defaults(doc, schema)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(obj)
    ]


def values_from_serve_yaml(path: Path) -> dict[str, Any]:
    """Chart values that describe the (single) application of a `serve run` config file."""
    config = yaml.safe_load(path.read_text())
    (app,) = config["applications"]
    (deployment,) = app.get("deployments", [{}])  # none: every Serve option is derived
    return {
        "serve": {
            "appName": app["name"],
            "routePrefix": app["route_prefix"],
            "importPath": app["import_path"],
            "proxyLocation": config.get("proxy_location", "EveryNode"),
            "args": app["args"],
            "deployment": deployment,
        }
    }


def drop_nulls(node: Any) -> Any:
    """Helm drops null-valued keys while merging values; compare configs without them."""
    if isinstance(node, dict):
        return {k: drop_nulls(v) for k, v in node.items() if v is not None}
    if isinstance(node, list):
        return [drop_nulls(v) for v in node]
    return node


# ---- serveConfigV2 -----------------------------------------------------------------------------


def serve_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(one(docs, "RayService")["spec"]["serveConfigV2"])


def ray_containers(rs: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rs["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]]
    pods += [g["template"] for g in cluster["workerGroupSpecs"]]
    return [c for p in pods for c in p["spec"]["containers"]]


def validate_with_ray(config: dict[str, Any]) -> None:
    """Check a Serve config with Ray Serve's own schema (skips where ray[serve] is absent). It
    imports the request router class too, so the router path must resolve."""
    schema = pytest.importorskip("ray.serve.schema", reason="ray[serve] is not installed")
    schema.ServeDeploySchema.model_validate(config)
