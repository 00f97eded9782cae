"""Map checkpoint tensors onto a model's parameters; refuse anything that does not fit."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from shortconv.errors import CheckpointError
from shortconv.execution.parallel import ParallelContext
from shortconv.layers.linear import load_shard_
from shortconv.models.mapped import adopt_, can_adopt

# Per-expert layout (original LFM2-MoE release): experts.{e}.w1/w3/w2.weight → fused tensors.
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<w>w1|w2|w3)\.weight$")
_IGNORED = re.compile(r"(rotary_emb\.|\.inv_freq$|pos_emb\.)")


class WeightLoader:
    def __init__(self, model: nn.Module, tp: ParallelContext, renames: dict[str, str]):
        self.model, self.tp, self.renames = model, tp, renames
        self.params = dict(model.named_parameters())
        self.loaded: set[str] = set()
        self._experts: dict[str, dict[tuple[str, int], torch.Tensor]] = defaultdict(dict)

    def rename(self, name: str) -> str:
        for old, new in self.renames.items():
            name = name.replace(old, new)
        return name

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            if _IGNORED.search(hf_name):
                continue
            name = self.rename(hf_name)
            m = _PER_EXPERT.match(name)
            if m:
                self._experts[m["prefix"]][(m["w"], int(m["e"]))] = tensor
                continue
            if name == "lm_head.weight" and name not in self.params:
                continue  # tied to the embedding: the checkpoint's copy is redundant
            if name not in self.params:
                unexpected.append(hf_name)
                continue
            self.put(name, tensor, hf_name)
        if unexpected:
            raise CheckpointError(
                f"checkpoint has {len(unexpected)} tensors this model does not know, e.g. "
                f"{unexpected[:5]}; is config.json right for these weights?"
            )
        self._fuse_experts()
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise CheckpointError(
                f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}"
            )

    def put(self, name: str, tensor: torch.Tensor, hf_name: str) -> None:
        param = self.params[name]
        if tensor.dim() == param.dim() + 1 and tensor.shape[1] == 1 and "conv" in name:
            tensor = tensor.squeeze(1)  # depthwise Conv1d weight [C, 1, W] → [C, W]
        if can_adopt(param, tensor, self.tp):
            adopt_(param, tensor)  # the checkpoint's mapped pages, no copy
        else:
            load_shard_(param, tensor, self.tp, hf_name)
        self.loaded.add(name)

    def _fuse_experts(self) -> None:
        for prefix, parts in self._experts.items():
            n = 1 + max(e for _, e in parts)
            try:
                w1 = torch.stack([parts[("w1", e)] for e in range(n)])
                w3 = torch.stack([parts[("w3", e)] for e in range(n)])
                w2 = torch.stack([parts[("w2", e)] for e in range(n)])
            except KeyError as exc:
                raise CheckpointError(f"{prefix}: expert tensor {exc} missing") from exc
            self.put(f"{prefix}.gate_up_proj", torch.cat([w1, w3], dim=1), f"{prefix}.*.w1/w3")
            self.put(f"{prefix}.down_proj", w2, f"{prefix}.*.w2")
