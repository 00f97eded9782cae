"""SamplingParams validation: every bad value is a ValueError naming its field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from shortconv.sampling.sampling_params import SamplingParams

NAN = float("nan")
INF = float("inf")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", NAN),
        ("temperature", INF),
        ("temperature", "1.0"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.0001),
        ("top_p", -0.5),
        ("top_p", NAN),
        ("top_k", 2.5),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", NAN),
        ("seed", 1.5),
        ("seed", "7"),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop", [f"s{i}" for i in range(SamplingParams.MAX_STOP_STRINGS + 1)]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.5]),
        ("stop_token_ids", ["2"]),
        ("stop_token_ids", [None]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 5),
        ("logprobs", -1),
        ("logprobs", SamplingParams.MAX_LOGPROBS + 1),
        ("logprobs", 1.5),
        ("logprobs", "3"),
        ("logprobs", True),
    ],
)
def test_invalid_value_raises_naming_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_defaults_are_valid() -> None:
    p = SamplingParams()
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.min_p == 0.0
    assert p.max_tokens == 16 and p.logprobs is None and p.seed is None
    assert p.stop == () and p.stop_token_ids == () and not p.ignore_eos
    assert not p.greedy


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0),
        dict(temperature=2),
        dict(top_p=1),
        dict(top_p=1e-9),
        dict(top_k=-1),
        dict(top_k=100_000),
        dict(min_p=0),
        dict(min_p=1.0),
        dict(seed=-5),
        dict(seed=2**70),
        dict(max_tokens=1),
        dict(logprobs=0),
        dict(logprobs=SamplingParams.MAX_LOGPROBS),
        dict(stop=[f"s{i}" for i in range(SamplingParams.MAX_STOP_STRINGS)]),
    ],
)
def test_boundary_values_are_valid(kw: dict[str, Any]) -> None:
    SamplingParams(**kw)


def test_lists_become_tuples_and_params_are_hashable() -> None:
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert p.stop == ("a", "bc") and isinstance(p.stop, tuple)
    assert p.stop_token_ids == (3, 4) and isinstance(p.stop_token_ids, tuple)
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(3, 4)))


def test_single_string_and_none_stop() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()  # type: ignore[arg-type]


def test_numpy_style_int_token_ids_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    p = SamplingParams(stop_token_ids=[np.int64(7)])
    assert p.stop_token_ids == (7,) and type(p.stop_token_ids[0]) is int


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1, temperature=0.8).greedy
    assert not SamplingParams(temperature=1e-6).greedy


def test_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
