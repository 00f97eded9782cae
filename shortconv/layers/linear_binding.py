"""Bind each linear layer's method once at build, from the engine's choices, and run each
method's post-load hook once the weights are in.

The choice per layer is fixed here (quantized or float; our AVX2 kernel, oneDNN or F.linear),
so the forward never asks what kind of weight it holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from shortconv.errors import ConfigError
from shortconv.kernels.cpu_gemm import Q8_BLOCK
from shortconv.layers.int4_mix import q6_ffn_down
from shortconv.layers.linear import LinearBase
from shortconv.layers.linear_cpu_gemm import CPU_GEMM_MAX_ROWS, CpuGemmLinear
from shortconv.layers.linear_float import FLOAT, cpu_float_method
from shortconv.layers.linear_method import LinearMethod
from shortconv.layers.quantize import Q4Linear, Q6Linear, Q8Linear
from shortconv.lora.batch import LoraBatch
from shortconv.lora.experts import bind_expert_lora
from shortconv.lora.linear import LoRALinear

# The method each `quantization` binds (all run on our AVX2 kernels, on CPU).
Quantized = type[Q8Linear] | type[Q4Linear] | type[Q6Linear]
QUANTIZED: dict[str, Quantized] = {"int8": Q8Linear, "int4": Q4Linear}
# The LM head's method under each `quantization` (with quantize_lm_head). int4 keeps its head
# in q6, as llama.cpp's Q4_K_M keeps its output tensor at Q6_K: the head's rounding lands on
# the logits directly. On the tiny models a q4 head added 3-15% to int4's KL, a q8 one under
# 0.1%; q6 reads 0.72x q8's bytes (docs/quantization.md, Quality).
LM_HEAD_QUANTIZED: dict[str, Quantized] = {"int8": Q8Linear, "int4": Q6Linear}
# Under int4, the ffn_down layers of Q4_K_M's rule take q6 too (layers.int4_mix): on the
# LFM2-350M shape against llama.cpp's tokens, mean KL 2.757 -> 2.685 (Q4_K_M: 2.690) for 7 MB
# more a token (docs/quantization.md).
INT4_Q6_FFN_DOWN = True


@dataclass(frozen=True)
class LinearPolicy:
    """The engine's linear choices (EngineConfig), with what start-up found: `cpu_gemm` is
    True only where our AVX2 kernels are wanted (cpu_kernels) and loaded, and then fp32
    layers take our tile up to `cpu_gemm_max_rows` rows (this machine's crossover,
    layers.linear_rows), torch's linear above. The default is torch's own paths, as a model
    built outside the runner gets."""

    quantization: str = "none"
    quantize_lm_head: bool = True
    cpu_gemm: bool = False
    cpu_gemm_max_rows: int = CPU_GEMM_MAX_ROWS
    prepack: bool = False
    # With LoRA enabled: the model's step rows, shared by every layer wrapped in LoRALinear
    # (every projection but the LM head and empty shards).
    lora: LoraBatch | None = field(default=None, compare=False)
    # Body layers that take q6 under int4 (Q4_K_M's ffn_down rule: layers.int4_mix), filled
    # from the model's layer names by bind_linear_methods when INT4_Q6_FFN_DOWN.
    q6_layers: frozenset[str] = frozenset()

    def method_for(self, name: str, layer: LinearBase, shared: bool) -> LinearMethod:
        """The method for `layer` (qualified `name`); `shared`: another module holds its
        weight (a tied embedding), so a quantized layer keeps the float copy."""
        base = self._base_method(name, layer, shared)
        if self.lora is None or layer.is_lm_head or not layer.weight.numel():
            return base
        return LoRALinear(base, self.lora)

    def _base_method(self, name: str, layer: LinearBase, shared: bool) -> LinearMethod:
        w = layer.weight
        if not w.numel():
            return FLOAT  # an empty shard (ZAYA1's delayed values on some ranks)
        table = LM_HEAD_QUANTIZED if layer.is_lm_head else QUANTIZED
        quantized = Q6Linear if name in self.q6_layers else table.get(self.quantization)
        if quantized is not None and (self.quantize_lm_head or not layer.is_lm_head):
            if w.shape[1] % Q8_BLOCK:  # q8's, q4's and q6's blocks are all 32 weights
                raise ConfigError(
                    f"quantization={self.quantization!r} needs each rank's input features to "
                    f"be a multiple of {Q8_BLOCK}; {name} has {w.shape[1]} (serve it with "
                    "quantization='none' or another tp_size)"
                )
            return quantized(keep_float=shared)
        if not (w.device.type == "cpu" and w.dtype == torch.float32 and not w.requires_grad):
            return FLOAT
        larger = cpu_float_method(w, self.prepack)
        return CpuGemmLinear(larger, self.cpu_gemm_max_rows) if self.cpu_gemm else larger


# torch's own paths, no quantization: a model built outside the runner (tests, oracles).
TORCH_LINEARS = LinearPolicy()


def linear_layers(model: nn.Module) -> list[tuple[str, LinearBase]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]


def bind_linear_methods(model: nn.Module, policy: LinearPolicy) -> Counter[str]:
    """Give every linear layer of `model` its method (all checked before any is bound);
    returns how many layers took each method, by name (the start-up log)."""
    shared = {
        id(p)
        for m in model.modules()
        if not isinstance(m, LinearBase)
        for p in m.parameters(recurse=False)
    }
    layers = linear_layers(model)
    if policy.quantization == "int4" and INT4_Q6_FFN_DOWN:
        policy = replace(policy, q6_layers=q6_ffn_down(n for n, _ in layers))
    methods = [policy.method_for(n, m, id(m.weight) in shared) for n, m in layers]
    for (_, layer), method in zip(layers, methods, strict=True):
        layer.method = method
    if policy.lora is not None:
        # Fused routed experts are no linear layer: their adapter slots are bound here too.
        bind_expert_lora(model, policy.lora)
    return Counter(m.name for m in methods)


def process_linears_after_load(model: nn.Module) -> None:
    """Each linear layer's method turns its loaded float weight into its own layout."""
    for _, layer in linear_layers(model):
        layer.method.process_after_load(layer)
