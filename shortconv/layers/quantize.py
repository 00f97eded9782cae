"""Quantize a loaded model's linear weights in place (`EngineConfig.quantization`).

Runs on each rank after its shard is loaded, so each weight is quantized once per rank. A row's
scale is its whole row's, whatever the sharding: column-parallel ranks hold whole rows, and a
row-parallel shard (part of every row's columns) takes the largest magnitude over the ranks
(one max all-reduce per layer at start-up), so TP ranks hold exactly TP 1's integers, split.
The quantized layers keep the int8 copy only: the float weight is dropped.

Which weights: every `Packable` projection (attention, short conv, CCA, the dense MLPs) except
the LM head, which stays in the model dtype like the embedding it often shares. Routed experts
(`FusedExperts`) are not quantized yet (they keep the model dtype).
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from shortconv.kernels.int8_linear_cpu import Int8Weight, pack_int8, quantize_int8, row_amax
from shortconv.layers.linear import Packable, RowParallelLinear
from shortconv.layers.vocab import LMHead


def quantizable(model: nn.Module) -> list[tuple[str, Packable]]:
    """The layers `quantize_linears` converts, by qualified name."""
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, Packable) and not isinstance(mod, LMHead) and mod.weight.numel()
    ]


def quantize_linears(model: nn.Module, method: str) -> int:
    """Quantize `model`'s linear weights with `method` ("none" or "int8"); returns how many
    layers were converted. Support is checked before (configs.support.check_quantization)."""
    if method == "none":
        return 0
    if method != "int8":
        raise ValueError(f"unknown quantization {method!r}")
    layers = quantizable(model)
    for _, mod in layers:
        amax = None
        if isinstance(mod, RowParallelLinear):  # every rank holds part of each row
            amax = mod.tp.all_reduce_max(row_amax(mod.weight))
        qweight, scale = quantize_int8(mod.weight, amax)
        mod.packed = pack_int8(qweight, scale)
        # The float weight goes: an empty tensor keeps the attribute (and its dtype) in place.
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
        if isinstance(mod, Packable) and isinstance(mod.packed, Int8Weight):
            out["int8"] += mod.packed.nbytes
    return dict(out)
