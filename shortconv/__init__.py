"""shortconv: a serving engine for hybrid short-convolution LMs (LFM2, LFM2-MoE, ZAYA1)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shortconv.engine.outputs import RequestOutput
    from shortconv.llm import LLM
    from shortconv.sampling.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

# NOTE: resolved on first use, so a process that needs one light module (the HTTP ingress
# parses requests with shortconv.sampling) does not import torch and the engine with it.
_LAZY = {
    "LLM": "shortconv.llm",
    "RequestOutput": "shortconv.engine.outputs",
    "SamplingParams": "shortconv.sampling.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'shortconv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
