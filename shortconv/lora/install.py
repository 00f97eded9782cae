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
from shortconv.layers.shard import shard_ranges
from shortconv.lora.adapter import LoraAdapter, LoraError, LoraTensors
from shortconv.lora.install_experts import expert_targets, place_expert
from shortconv.lora.linear import LoRALinear, LoraSlots
from shortconv.lora.shard_read import ShardPlan, read_shards


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
    """Put `adapter` (B pre-scaled) into `slot`; LoraError naming the module otherwise. Only
    this rank's shard of each tensor is read from the file (lora.shard_read), after every
    module's shapes are checked from the file's header.

    NOTE: a module whose layer holds an empty shard on this rank (ZAYA1's delayed values on
    the rank with no previous-token head) has nothing to adapt here; its other ranks check it."""
    layers = lora_layers(model)
    # NOTE: by method, not by weight alone: a q8 layer's float weight is empty after load too.
    empty = {n for n, m in linear_layers(model) if m.method is FLOAT and not m.weight.numel()}
    experts = expert_targets(model)
    targets = {name: _ours(name, renames) for name in adapter.modules}
    fused = {name: experts[ours] for name, ours in targets.items() if ours in experts}
    placed = {
        name: _placed(name, renames, layers, adapter, tp)
        for name, ours in targets.items()
        if ours not in empty and name not in fused
    }
    plans = {name: plan for name, (_, plan) in placed.items()}
    plans |= {name: place_expert(name, target, adapter, tp) for name, target in fused.items()}
    shards = read_shards(adapter, plans)
    clear_slot(model, slot)
    with torch.no_grad():
        for name, (layer, _) in placed.items():
            a, b = shards[name]
            slots, r = _slots(layer), a.shape[0]
            slots.a[slot, :r].copy_(a)
            slots.b[slot, :, :r].copy_(b * adapter.scale)
            slots.ranks[slot] = r
        for name, target in fused.items():
            target.slots.write(slot, *shards[name], adapter.scale)


def clear_slot(model: nn.Module, slot: int) -> None:
    """Empty `slot` in every LoRA layer: rank 0, A and B zero."""
    with torch.no_grad():
        for layer in lora_layers(model).values():
            _slots(layer).ranks[slot] = 0
            _slots(layer).a[slot].zero_()
            _slots(layer).b[slot].zero_()
        for target in expert_targets(model).values():
            target.slots.clear(slot)


def slot_weight_sum(model: nn.Module, slot: int) -> float:
    """|A| + |B| of `slot` summed over every LoRA layer, plus its ranks: 0 for an empty slot
    (tests read it on every rank after an unload)."""
    total = 0.0
    for layer in lora_layers(model).values():
        s = _slots(layer)
        total += float(s.a[slot].abs().sum() + s.b[slot].abs().sum()) + int(s.ranks[slot])
    return total + sum(t.slots.weight_sum(slot) for t in expert_targets(model).values())


def _slots(layer: LinearBase) -> LoraSlots:
    assert layer.lora is not None, "a LoRA layer gets its slots in process_after_load"
    return layer.lora


def _placed(
    hf_module: str,
    renames: dict[str, str],
    layers: dict[str, LinearBase],
    adapter: LoraAdapter,
    tp: ParallelContext,
) -> tuple[LinearBase, ShardPlan]:
    """The layer `hf_module` adapts and the part of its (A, B) this rank reads, checked."""
    layer = layers.get(_ours(hf_module, renames))
    if layer is None:
        raise LoraError(
            f"{adapter.path}: target module {hf_module!r} is not a projection this engine "
            f"adapts (supported: {_leaf_names(layers)})",
            "target",
        )
    t = adapter.modules[hf_module]
    slots = _slots(layer)
    if t.rank > slots.a.shape[1]:
        raise LoraError(
            f"{adapter.path}: {hf_module} has rank {t.rank}, above max_lora_rank "
            f"{slots.a.shape[1]}",
            "rank",
        )
    plan = _shard_plan(layer, t, tp)
    (_, local_in), (local_out, _) = plan.local_shapes(t)
    if local_in != slots.a.shape[2] or local_out != slots.b.shape[1]:
        raise LoraError(
            f"{adapter.path}: {hf_module} is [{t.b_shape[0]} x {t.a_shape[1]}] in the adapter, "
            f"but this model's layer is not (an adapter for another base model?)",
            "shape",
        )
    return layer, plan


def _shard_plan(layer: LinearBase, t: LoraTensors, tp: ParallelContext) -> ShardPlan:
    """A and B sharded with the base weight: a column-parallel (or row-sliced) weight splits
    B's rows as its own; a row-parallel one splits A's columns."""
    dim = getattr(layer.weight, "shard_dim", None)
    if dim == 0:
        return ShardPlan(b_rows=shard_ranges(layer.weight, t.b_shape[0], tp))
    if dim == 1:
        return ShardPlan(a_cols=shard_ranges(layer.weight, t.a_shape[1], tp))
    return ShardPlan()


def _ours(hf_module: str, renames: dict[str, str]) -> str:
    """Our qualified module name for a checkpoint's module name."""
    return _rename(f"{hf_module}.weight", renames).removesuffix(".weight")


def _rename(name: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        name = name.replace(old, new)
    return name


def _leaf_names(layers: dict[str, LinearBase]) -> list[str]:
    return sorted({n.rpartition(".")[2] for n in layers})
