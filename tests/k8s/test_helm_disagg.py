"""The chart passes `serve.args.disaggregation` through to the app (which builds the prefill
and decode deployments from it) and refuses a malformed one at render time. Separate worker
groups per role are not rendered (docs/disaggregation.md)."""

from __future__ import annotations

import pytest
import yaml

pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) is not installed")

import helm_utils as hu  # noqa: E402

from deployments.serve.app import parse_args  # noqa: E402

SPLIT = {"prefill_replicas": 1, "decode_replicas": 2, "prefill_tp_size": 1}


def test_disaggregation_reaches_the_app_args() -> None:
    values = {"serve": {"args": {"disaggregation": SPLIT, "replica_num_cpus": 1.0}}}
    values["serve"]["args"] |= {"min_replicas": 2, "max_replicas": 2}
    docs = hu.render(values)
    serve_config = yaml.safe_load(hu.one(docs, "RayService")["spec"]["serveConfigV2"])
    args = serve_config["applications"][0]["args"]
    assert args["disaggregation"] == SPLIT
    assert parse_args(args).disaggregation is not None  # the app accepts what it renders


@pytest.mark.parametrize(
    "bad",
    [{"prefill_replicas": 0, "decode_replicas": 1}, {"decode_replicas": 1}, {**SPLIT, "x": 1}],
)
def test_malformed_disaggregation_is_refused(bad: dict) -> None:
    with pytest.raises(Exception, match="disaggregation"):
        hu.render({"serve": {"args": {"disaggregation": bad}}})
