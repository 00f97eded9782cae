"""What must import without torch: the app's build task (`deployments.serve.app:build`, run by Serve
before any replica starts, so its imports are on the start-up's critical path) and the HTTP
ingress, whose process never computes. Importing torch there cost about 2.6 s of the build
on the 2-core machine (docs/serving_path.md)."""

from __future__ import annotations

import pytest
from probe import run_probe


@pytest.mark.parametrize("module", ["deployments.serve.app", "deployments.serve.ingress"])
def test_imports_without_torch(module: str) -> None:
    probe = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    stdout = run_probe(probe)
    assert stdout.strip() == "", f"{module} imported {stdout.strip()}"


def test_the_app_still_builds_its_deployments() -> None:
    """The lazily imported pieces are still the ones Serve deploys."""
    from deployments.serve.app import build_app, parse_args

    ingress = build_app(parse_args({"max_replicas": 1}))._bound_deployment
    llm = ingress.init_args[0]._bound_deployment
    assert (ingress.name, llm.name) == ("OpenAIIngress", "LLMServer")
