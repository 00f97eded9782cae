"""Weights load as views of the checkpoint's mapped file (no second copy), and a write to one
stays in this process (the mapping is private)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from shortconv.configs.config import ModelConfig
from shortconv.execution.parallel import ParallelContext
from shortconv.models.build import build_model
from shortconv.models.loader import iter_checkpoint
from shortconv.models.registry import model_class
from shortconv.tiny.checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("mapped"), seed=3)


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """This process's address ranges that map `path`."""
    out = []
    with open(f"/proc/{os.getpid()}/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path.resolve())):
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def load(ckpt: Path) -> torch.nn.Module:
    cfg = ModelConfig.from_dir(ckpt)
    model = build_model(model_class(cfg.arch), cfg, ParallelContext(), "cpu", torch.float32)
    model.load_weights(iter_checkpoint(ckpt))
    return model


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_weights_are_the_mapped_file_and_writes_stay_private(ckpt: Path) -> None:
    (weights_file,) = ckpt.glob("*.safetensors")
    digest = hashlib.sha256(weights_file.read_bytes()).hexdigest()
    model = load(ckpt)
    ranges = mapped_ranges(weights_file)
    params = dict(model.named_parameters())
    inside = [n for n, p in params.items() if any(lo <= p.data_ptr() < hi for lo, hi in ranges)]
    # NOTE: at tp_size=1 every fp32 tensor of the checkpoint is adopted as it is.
    assert ranges and sorted(set(params) - set(inside)) == []
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)  # copy-on-write: this process's pages only
    assert hashlib.sha256(weights_file.read_bytes()).hexdigest() == digest
    fresh = dict(load(ckpt).named_parameters())
    for name, p in params.items():
        torch.testing.assert_close(fresh[name] + 1.0, p)
