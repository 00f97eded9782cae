"""`disaggregation:` in the app args: off by default, refused with its reason where it cannot
work, and each role's replicas get their own count and TP degree."""

from __future__ import annotations

import pytest

from deployments.serve.app import AppArgsError, parse_args
from deployments.serve.disagg_app import role_args

SPLIT = {"prefill_replicas": 1, "decode_replicas": 2}


def test_off_by_default() -> None:
    assert parse_args({}).disaggregation is None


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"max_replicas": 3}, "max_replicas=3 must equal it"),
        ({"min_replicas": 1, "max_replicas": 2}, "min_replicas=1 must equal it"),
        ({"enable_lora": True}, "cannot hand off LoRA requests"),
        ({"replica_num_cpus": "all"}, "give replica_num_cpus a number"),
        ({"disaggregation": {"prefill_replicas": 0, "decode_replicas": 1}}, "prefill_replicas"),
        ({"disaggregation": {"prefill_replicas": 1}}, "decode_replicas"),
        ({"disaggregation": {**SPLIT, "prefill_tp": 2}}, "prefill_tp"),
    ],
)
def test_refused_with_its_reason(extra: dict, reason: str) -> None:
    with pytest.raises(AppArgsError, match=reason):
        parse_args({"disaggregation": SPLIT, **extra})


def test_bounds_equal_to_the_decode_count_are_accepted() -> None:
    args = parse_args({"disaggregation": SPLIT, "min_replicas": 2, "max_replicas": 2})
    assert args.disaggregation is not None


def test_each_role_runs_its_own_count_and_tp() -> None:
    args = parse_args({"tp_size": 2, "disaggregation": {**SPLIT, "prefill_tp_size": 1}})
    pre, dec = role_args(args, "prefill"), role_args(args, "decode")
    assert (pre.tp_size, pre.min_replicas, pre.max_replicas) == (1, 1, 1)
    assert (dec.tp_size, dec.min_replicas, dec.max_replicas) == (2, 2, 2)
    # A replica's args validate again there: without `disaggregation`, so without refusals.
    for role in (pre, dec):
        assert role.disaggregation is None
        assert parse_args(role.model_dump()) == role
