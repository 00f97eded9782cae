"""Quantize a loaded model's linear weights in place (`EngineConfig.quantization`).

"int8" is q8 (kernels/cpu_gemm): int8 weights with one fp32 scale per 32 consecutive weights
of a row. Runs on each rank after its shard is loaded, so each weight is quantized once per
rank. A block never straddles two ranks: column-parallel ranks hold whole rows, and a
row-parallel shard starts at a multiple of its width, which must be a multiple of 32 (checked
here, with the layer named), so TP ranks hold exactly TP 1's integers and scales, split. The
quantized layers keep the int8 copy only: the float weight is dropped.

Which weights: every `Packable` projection (attention, short conv, CCA, the dense MLPs); the LM
head only when asked (`lm_head=True`): a head tied to the embedding then gets a quantized copy
and the float weight stays for the embedding's lookups. Routed experts (`FusedExperts`) are not
quantized yet (they keep the model dtype).
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from shortconv.errors import ConfigError
from shortconv.kernels.cpu_gemm import Q8_BLOCK, Q8Weight, quantize_q8
from shortconv.layers.linear import Packable
from shortconv.layers.vocab import LMHead


def quantizable(model: nn.Module, lm_head: bool = False) -> list[tuple[str, Packable]]:
    """The layers `quantize_linears` converts, by qualified name."""
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, Packable)
        and (lm_head or not isinstance(mod, LMHead))
        and mod.weight.numel()
    ]


def quantize_linears(model: nn.Module, method: str, lm_head: bool = False) -> int:
    """Quantize `model`'s linear weights with `method` ("none" or "int8"), the LM head too with
    `lm_head`; returns how many layers were converted. Support is checked before
    (configs.support.check_quantization)."""
    if method == "none":
        return 0
    if method != "int8":
        raise ValueError(f"unknown quantization {method!r}")
    layers = quantizable(model, lm_head)
    # Weights another module also holds (an embedding tied to the LM head) keep their float copy.
    shared = {
        id(p)
        for m in model.modules()
        if not isinstance(m, Packable)
        for p in m.parameters(recurse=False)
    }
    for name, mod in layers:
        if mod.weight.shape[1] % Q8_BLOCK:
            raise ConfigError(
                f"quantization='int8' needs each rank's input features to be a multiple of "
                f"{Q8_BLOCK}; {name} has {mod.weight.shape[1]} (serve it with "
                "quantization='none' or another tp_size)"
            )
    for _, mod in layers:
        mod.packed = quantize_q8(mod.weight)
        if id(mod.weight) not in shared:
            # The float weight goes: an empty tensor keeps the attribute (and its dtype).
            mod.weight = nn.Parameter(mod.weight.new_empty(0), requires_grad=False)
    return len(layers)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of `model`'s weights on this rank by storage dtype (int8 weights with their fp32
    scales under "int8"); a tensor shared by two modules (a tied LM head) counts once."""
    out: Counter[str] = Counter()
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen and p.numel():
            seen.add(id(p))
            out[str(p.dtype).removeprefix("torch.")] += p.numel() * p.element_size()
    for mod in model.modules():
        if isinstance(mod, Packable) and isinstance(mod.packed, Q8Weight):
            out["int8"] += mod.packed.nbytes
    return dict(out)
