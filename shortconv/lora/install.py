"""Write one adapter into one slot of every LoRA layer of a model (on each rank, its shard).

Everything is checked before any slot is written, so a refused adapter leaves the slot as it
was; the slot is then cleared in every layer and filled in the layers the adapter targets.
"""

from __future__ import annotations

import torch
from torch import nn

from shortconv.execution.parallel import ParallelContext
from shortconv.layers.linear import LinearBase
from shortconv.layers.linear_binding import linear_layers
from shortconv.layers.linear_float import FLOAT
from shortconv.layers.shard import rank_block
from shortconv.lora.adapter import LoraAdapter, LoraError
from shortconv.lora.linear import LoRALinear, LoraSlots

_Pair = tuple[torch.Tensor, torch.Tensor]


def lora_layers(model: nn.Module) -> dict[str, LinearBase]:
    """The model's layers bound to a LoRA method, by qualified name."""
    return {n: m for n, m in linear_layers(model) if isinstance(m.method, LoRALinear)}


def install_adapter(
    model: nn.Module,
    renames: dict[str, str],
    slot: int,
    adapter: LoraAdapter,
    tp: ParallelContext,
) -> None:
    """Put `adapter` (B pre-scaled) into `slot`; LoraError naming the module otherwise.

    NOTE: a module whose layer holds an empty shard on this rank (ZAYA1's delayed values on
    the rank with no previous-token head) has nothing to adapt here; its other ranks check it."""
    layers = lora_layers(model)
    # NOTE: by method, not by weight alone: a q8 layer's float weight is empty after load too.
    empty = {n for n, m in linear_layers(model) if m.method is FLOAT and not m.weight.numel()}
    placed = [
        _placed(name, renames, layers, adapter, tp)
        for name in adapter.weights
        if _ours(name, renames) not in empty
    ]
    clear_slot(model, slot)
    with torch.no_grad():
        for layer, (a, b) in placed:
            slots, r = _slots(layer), a.shape[0]
            slots.a[slot, :r].copy_(a)
            slots.b[slot, :, :r].copy_(b * adapter.scale)
            slots.ranks[slot] = r


def clear_slot(model: nn.Module, slot: int) -> None:
    """Empty `slot` in every LoRA layer: rank 0, A and B zero."""
    with torch.no_grad():
        for layer in lora_layers(model).values():
            _slots(layer).ranks[slot] = 0
            _slots(layer).a[slot].zero_()
            _slots(layer).b[slot].zero_()


def slot_weight_sum(model: nn.Module, slot: int) -> float:
    """|A| + |B| of `slot` summed over every LoRA layer, plus its ranks: 0 for an empty slot
    (tests read it on every rank after an unload)."""
    total = 0.0
    for layer in lora_layers(model).values():
        s = _slots(layer)
        total += float(s.a[slot].abs().sum() + s.b[slot].abs().sum()) + int(s.ranks[slot])
    return total


def _slots(layer: LinearBase) -> LoraSlots:
    assert layer.lora is not None, "a LoRA layer gets its slots in process_after_load"
    return layer.lora


def _placed(
    hf_module: str,
    renames: dict[str, str],
    layers: dict[str, LinearBase],
    adapter: LoraAdapter,
    tp: ParallelContext,
) -> tuple[LinearBase, _Pair]:
    """The layer `hf_module` adapts and this rank's (A, B) for it, checked."""
    layer = layers.get(_ours(hf_module, renames))
    if layer is None:
        raise LoraError(
            f"{adapter.path}: target module {hf_module!r} is not a projection this engine "
            f"adapts (supported: {_leaf_names(layers)})",
            "target",
        )
    a, b = adapter.weights[hf_module]
    slots = _slots(layer)
    if a.shape[0] > slots.a.shape[1]:
        raise LoraError(
            f"{adapter.path}: {hf_module} has rank {a.shape[0]}, above max_lora_rank "
            f"{slots.a.shape[1]}",
            "rank",
        )
    local = _shard(layer, a, b, tp)
    want_in, want_out = slots.a.shape[2], slots.b.shape[1]
    if local[0].shape[1] != want_in or local[1].shape[0] != want_out:
        raise LoraError(
            f"{adapter.path}: {hf_module} is [{b.shape[0]} x {a.shape[1]}] in the adapter, "
            f"but this model's layer is not (an adapter for another base model?)",
            "shape",
        )
    return layer, local


def _shard(layer: LinearBase, a: torch.Tensor, b: torch.Tensor, tp: ParallelContext) -> _Pair:
    """A and B sharded with the base weight: a column-parallel (or row-sliced) weight splits
    B's rows as its own; a row-parallel one splits A's columns."""
    dim = getattr(layer.weight, "shard_dim", None)
    if dim == 0:
        return a, rank_block(layer.weight, b, tp)
    if dim == 1:
        return rank_block(layer.weight, a, tp), b
    return a, b


def _ours(hf_module: str, renames: dict[str, str]) -> str:
    """Our qualified module name for a checkpoint's module name."""
    return _rename(f"{hf_module}.weight", renames).removesuffix(".weight")


def _rename(name: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        name = name.replace(old, new)
    return name


def _leaf_names(layers: dict[str, LinearBase]) -> list[str]:
    return sorted({n.rpartition(".")[2] for n in layers})
