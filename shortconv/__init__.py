"""shortconv: a serving engine for hybrid short-convolution LMs (LFM2, LFM2-MoE, ZAYA1)."""

from shortconv.llm import LLM
from shortconv.outputs import RequestOutput
from shortconv.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
