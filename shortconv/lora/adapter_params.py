"""PEFT's `target_parameters` adapters: which parameter each saved A/B pair adapts.

PEFT wraps a targeted parameter (a fused expert weight [E, out, in]) in a `ParamWrapper`; two
targeted parameters of one module are two nested wrappers, so the file names them by nesting
depth, not by parameter: `<module>.lora_A.weight` is the outermost wrapper's,
`<module>.base_layer.lora_A.weight` the one inside it. PEFT wraps a module's parameters in the
order the module registers them, so the innermost wrapper is the first registered one.
Each pair holds every expert: A [r * E, in] with expert e's rows at e*r.. (expert-major), B
[out, r * E] with expert e's rank rho at column rho*E + e (rank-major).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from shortconv.lora.tensors import LoraError, LoraTensors

# NOTE: the order transformers' fused experts (Lfm2MoeExperts, ZayaExperts) register their
# parameters in, which is PEFT's nesting order (innermost first).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_WRAPPED = ".base_layer"


def name_parameters(
    root: Path, modules: dict[str, LoraTensors], targets: list[str], rank: int
) -> dict[str, LoraTensors]:
    """`modules` with each `target_parameters` pair renamed to `<module>.<parameter>` and its
    expert count set; pairs of plain `target_modules` pass through."""
    if not targets:
        return modules
    out: dict[str, LoraTensors] = {}
    for stem, t in modules.items():
        module, depth = _unwrap(stem)
        params = [p for p in EXPERT_PARAMS if _targeted(f"{module}.{p}", targets)]
        if not params:
            if depth:
                raise LoraError(f"{root}: {stem!r} wraps a parameter no target names", "files")
            out[stem] = t
            continue
        if depth >= len(params):
            msg = f"{root}: {stem!r} is nested deeper than its {len(params)} targeted parameters"
            raise LoraError(msg, "files")
        out[f"{module}.{params[len(params) - 1 - depth]}"] = _experts(root, stem, t, rank)
    return out


def _unwrap(stem: str) -> tuple[str, int]:
    depth = 0
    while stem.endswith(_WRAPPED):
        stem, depth = stem.removesuffix(_WRAPPED), depth + 1
    return stem, depth


def _targeted(key: str, targets: list[str]) -> bool:
    """PEFT's match: the full name, or a suffix of it at a dot."""
    return any(key == t or key.endswith(f".{t}") for t in targets)


def _experts(root: Path, stem: str, t: LoraTensors, rank: int) -> LoraTensors:
    stacked = t.a_shape[0]
    if stacked % rank:
        msg = f"{root}: {stem} stacks {stacked} ranks, not a multiple of r = {rank}"
        raise LoraError(msg, "files")
    return replace(t, experts=stacked // rank)
