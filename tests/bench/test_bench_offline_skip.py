"""bench/offline.py where transformers lacks the architecture (ZAYA on the GPU machine's older
pin): it says so and exits cleanly instead of crashing while writing the checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import offline  # noqa: E402


def test_missing_architecture_is_reported_not_crashed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lacks = {"zaya": "transformers 5.17.0 has no 'zaya' model type"}
    monkeypatch.setattr(offline, "transformers_lacks", lacks.get)

    def no_checkpoint(*_: object, **__: object) -> None:
        raise AssertionError("must not try to write a checkpoint")

    monkeypatch.setattr(offline, "make_tiny_checkpoint", no_checkpoint)
    offline.main(["--shape", "zaya1-tiny", "--device", "cuda", "--workloads", "b"])
    out = capsys.readouterr().out
    assert "SUMMARY offline shape=zaya1-tiny status=skipped" in out, out
    assert "torch reference" in out, out


def test_dry_run_names_the_missing_architecture(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(offline, "transformers_lacks", {"zaya": "no zaya here"}.get)
    offline.main(["--dry-run", "--shape", "zaya1-tiny"])
    assert "no zaya here" in capsys.readouterr().out
