"""Place an adapter's fused-expert pairs (PEFT's `target_parameters`) on a model's experts.

Checked like the dense layers' (lora.install): the target exists and can take an adapter,
the expert count, the rank and this rank's shard shapes, before any slot is written. The
pair shards with its base parameter: gate_up [E, 2I, H] splits its outputs (B's rows, per
gate/up half), down [E, H, I] its inputs (A's columns), as the checkpoint loader cuts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shortconv.execution.parallel import ParallelContext
from shortconv.layers.experts import FusedExperts
from shortconv.layers.shard import shard_ranges
from shortconv.lora.adapter import LoraAdapter, LoraError, LoraTensors
from shortconv.lora.experts import ExpertLoRA, ExpertLoraSlots
from shortconv.lora.shard_read import ShardPlan


@dataclass(frozen=True)
class ExpertTarget:
    """One fused parameter that can take an adapter: its slots, the base parameter (for its
    shard layout) and the experts' refusal (None: supported)."""

    slots: ExpertLoraSlots
    weight: nn.Parameter
    refusal: str | None


def expert_targets(model: nn.Module) -> dict[str, ExpertTarget]:
    """Our qualified parameter name → its target, for every fused expert parameter."""
    out: dict[str, ExpertTarget] = {}
    for name, m in model.named_modules():
        lora = m.lora if isinstance(m, FusedExperts) else None
        if isinstance(lora, ExpertLoRA):
            out[f"{name}.gate_up_proj"] = ExpertTarget(lora.gate_up, m.gate_up_proj, lora.refusal)
            out[f"{name}.down_proj"] = ExpertTarget(lora.down, m.down_proj, lora.refusal)
    return out


def place_expert(
    hf_name: str, target: ExpertTarget, adapter: LoraAdapter, tp: ParallelContext
) -> ShardPlan:
    """The part of `hf_name`'s pair this rank reads, after checking it fits `target`."""
    where = f"{adapter.path}: {hf_name}"
    t = adapter.modules[hf_name]
    if target.refusal is not None:
        raise LoraError(
            f"{where}: routed experts cannot take an adapter here ({target.refusal})", "target"
        )
    slots = target.slots
    if t.experts != slots.num_experts:
        msg = f"{where} has {t.experts} experts, this model's layer {slots.num_experts}"
        raise LoraError(f"{msg} (an adapter for another base model?)", "shape")
    if t.rank > slots.max_rank:
        msg = f"{where} has rank {t.rank}, above max_lora_rank {slots.max_rank}"
        raise LoraError(msg, "rank")
    plan = _shard_plan(target.weight, t, tp)
    (_, local_in), (local_out, _) = plan.local_shapes(t)
    if (local_out, local_in) != slots.local_shape():
        raise LoraError(
            f"{where} is [{t.b_shape[0]} x {t.a_shape[1]}] per expert in the adapter, but this "
            "model's experts are not (an adapter for another base model?)",
            "shape",
        )
    return plan


def _shard_plan(weight: nn.Parameter, t: LoraTensors, tp: ParallelContext) -> ShardPlan:
    dim = getattr(weight, "shard_dim", None)
    if dim == 1:
        return ShardPlan(b_rows=shard_ranges(weight, t.b_shape[0], tp))
    if dim == 2:
        return ShardPlan(a_cols=shard_ranges(weight, t.a_shape[1], tp))
    return ShardPlan()
