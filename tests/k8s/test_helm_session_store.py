"""The chart's durable-session volume: with `serve.args.session_store` set, every worker pod
mounts a volume at its path (the named PVC, else an emptyDir), the serve config passes the
store through, the manifests still validate; without it, no such volume anywhere."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) is not installed")
pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")

import helm_utils as hu  # noqa: E402

STORE = {"path": "/var/lib/shortconv/sessions", "ttl_s": 3600}


def _with_store(claim: str | None) -> dict[str, Any]:
    values: dict[str, Any] = {"serve": {"args": {"session_store": STORE}}}
    if claim is not None:
        values["sessionStore"] = {"existingClaim": claim}
    return values


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cluster = hu.one(docs, "RayService")["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    return {
        "head": cluster["headGroupSpec"]["template"]["spec"],
        "worker": group["template"]["spec"],
    }


def _store_volume(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in pod.get("volumes", []) if v["name"] == "session-store"]


def _store_mounts(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        m
        for c in pod["containers"]
        for m in c.get("volumeMounts", [])
        if m["name"] == "session-store"
    ]


@pytest.mark.parametrize("claim", ["shortconv-sessions", None, ""])
def test_worker_pods_mount_the_store_at_its_path(claim: str | None) -> None:
    docs = hu.render(_with_store(claim))
    pods = _pods(docs)
    (vol,) = _store_volume(pods["worker"])
    if claim:
        assert vol["persistentVolumeClaim"] == {"claimName": claim}
        assert "emptyDir" not in vol
    else:
        assert vol["emptyDir"] == {} and "persistentVolumeClaim" not in vol
    (mount,) = _store_mounts(pods["worker"])
    assert mount["mountPath"] == STORE["path"] and not mount.get("readOnly")
    assert not _store_volume(pods["head"]) and not _store_mounts(pods["head"])  # no replica there
    serve_config = yaml.safe_load(hu.one(docs, "RayService")["spec"]["serveConfigV2"])
    assert serve_config["applications"][0]["args"]["session_store"] == STORE
    for doc in docs:
        if not hu.is_custom_resource(doc):
            hu.validate_builtin(doc)
        elif hu.SCHEMAS_DIR.is_dir():
            assert hu.validate_custom(doc) == []


@pytest.mark.parametrize("case", hu.CASES)
def test_no_store_no_volume(case: str) -> None:
    for pod in _pods(hu.rendered(case)).values():
        assert not _store_volume(pod) and not _store_mounts(pod)


def test_unknown_store_key_is_refused() -> None:
    with pytest.raises(Exception, match="claimName"):
        hu.render({"sessionStore": {"claimName": "x"}})
