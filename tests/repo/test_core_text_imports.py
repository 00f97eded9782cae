"""What the engine core process must not import on the CPU text path: Triton (the GPU kernels;
`import triton` is seconds on the 2-core machine) and torchvision (the vision models'
processors). The probe builds the tiny LFM2 engine as the core does
(deployments/frontend/engine/engine_core.py) in a fresh interpreter and lists what of these it
imported (docs/serving_path.md, "Start-up")."""

from __future__ import annotations

from pathlib import Path

from probe import run_probe

HEAVY = ("triton", "torchvision")

PROBE = f"""
import sys
import deployments.frontend.engine.engine_core
from deployments.frontend.config.args import AppArgs
from deployments.frontend.engine.engine_build import make_engine
from workers.startup import PhaseClock
engine = make_engine(AppArgs(model=sys.argv[1], device="cpu"), None, PhaseClock())
engine.shutdown()
print(",".join(m for m in {HEAVY!r} if m in sys.modules))
"""


def test_core_text_path_imports_no_gpu_or_vision_stack(tmp_path: Path) -> None:
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("lfm2", tmp_path / "lfm2", seed=1)
    stdout = run_probe(PROBE, str(ckpt))
    assert stdout.strip().splitlines()[-1:] in ([], [""]), f"imported {stdout.strip()}"
