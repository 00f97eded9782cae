"""tests/gpu/test_gpu_graphs.py's checks run on CPU at tiny widths, so the GPU module's own code
(random stack, inference-mode handling, helpers) is exercised before it ever meets a GPU."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import test_gpu_graphs as gg  # noqa: E402

# Same layouts as the GPU configs, narrower and shallower (CPU time), vocab kept.
_SHRINK: dict[str, dict[str, Any]] = {
    "lfm2": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "block_ff_dim": 128,
    },
    "lfm2_moe": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
    },
    "zaya1": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "router_hidden_size": 16,
    },
}
TINY = {arch: {**raw, **_SHRINK[arch]} for arch, raw in gg.CONFIGS.items()}


def test_decode_matches_eager_on_cpu() -> None:
    gg.check_decode_matches_eager("cpu", TINY)


def test_failure_restores_state_on_cpu() -> None:
    gg.check_failure_restores("cpu", TINY)
