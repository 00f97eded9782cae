"""SamplingParams' logit controls: penalties, logit_bias, min_tokens; a refusal names its field."""

from __future__ import annotations

from typing import Any

import pytest

from shortconv.sampling.sampling_params import InvalidRequest, SamplingParams

NAN = float("nan")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.5),
        ("presence_penalty", NAN),
        ("presence_penalty", "1"),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", True),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above max_tokens (16)
        ("min_tokens", 1.5),
        ("logit_bias", {"5": 100.5}),
        ("logit_bias", {"5": -101}),
        ("logit_bias", {"5": NAN}),
        ("logit_bias", {"5": "1"}),
        ("logit_bias", {"five": 1.0}),
        ("logit_bias", {"-3": 1.0}),
        ("logit_bias", {"1.5": 1.0}),
        ("logit_bias", {-3: 1.0}),
        ("logit_bias", {True: 1.0}),
        ("logit_bias", 7),
        ("logit_bias", {str(i): 1.0 for i in range(SamplingParams.MAX_LOGIT_BIAS + 1)}),
    ],
)
def test_invalid_control_raises_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest, match=rf"SamplingParams\.{field}\b") as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


@pytest.mark.parametrize(
    "kw",
    [
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(repetition_penalty=1e-3),
        dict(repetition_penalty=5.0),
        dict(min_tokens=16),
        dict(min_tokens=0),
        dict(logit_bias={"0": -100, "7": 100}),
        dict(logit_bias={}),
    ],
)
def test_boundary_controls_are_valid(kw: dict[str, Any]) -> None:
    SamplingParams(**kw)


def test_logit_bias_is_frozen_into_sorted_int_pairs_and_hashable() -> None:
    p = SamplingParams(logit_bias={"9": 1, 3: -2.5})
    assert p.logit_bias == ((3, -2.5), (9, 1.0))
    assert hash(p) == hash(SamplingParams(logit_bias=[(9, 1.0), (3, -2.5)]))


def test_only_penalties_ask_for_the_history() -> None:
    assert not SamplingParams(logit_bias={"1": 3}, min_tokens=2).needs_output_counts
    assert SamplingParams(presence_penalty=0.5).needs_output_counts
    assert not SamplingParams(frequency_penalty=0.5).needs_prompt_tokens
    rep = SamplingParams(repetition_penalty=1.3)
    assert rep.needs_prompt_tokens and rep.needs_output_counts
