"""Only a transformers without the architecture may turn a ZAYA1 case into a skip."""

from __future__ import annotations

import sys

import pytest
from graph_helpers import zaya_skip_reason

from shortconv.configs.hf.availability import transformers_lacks


def test_known_and_unknown_model_types() -> None:
    assert transformers_lacks("lfm2") is None and transformers_lacks("zaya") is None
    reason = transformers_lacks("no_such_model_type")
    assert reason is not None and "no_such_model_type" in reason


def test_a_broken_zaya_module_is_not_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "shortconv.models.zaya1", None)  # its import now raises
    assert zaya_skip_reason() is None  # so the case runs, and fails loudly on the import
    with pytest.raises(ImportError):
        import shortconv.models.zaya1  # noqa: F401


def test_a_transformers_without_zaya_is_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.auto import configuration_auto

    monkeypatch.setattr(configuration_auto, "CONFIG_MAPPING", {"lfm2": None})
    reason = zaya_skip_reason()
    assert reason is not None and "'zaya'" in reason
