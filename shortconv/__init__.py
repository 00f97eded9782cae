"""shortconv: a serving engine for hybrid short-convolution LMs (LFM2, LFM2-MoE, ZAYA1)."""

from shortconv.engine.outputs import RequestOutput
from shortconv.llm import LLM
from shortconv.sampling.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
