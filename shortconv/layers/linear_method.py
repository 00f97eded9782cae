"""The linear-method seam: each linear layer holds one `LinearMethod`, bound once at build.

A method owns how its layer's weight is laid out after load (float as loaded, a oneDNN-blocked
copy beside it, q8 in its place) and how `apply` computes x W^T + b from that layout, with the
kernel chosen when the method was picked (shortconv.layers.linear_binding), never per call.
The layer owns its shape and TP sharding; the method never sees the checkpoint's full tensor.

NOTE: methods are immutable and hold no tensors; what a method derives from the weight lives
on the layer (`layer.blocked`, `layer.q8`, `layer.q4`, `layer.q6`), so one method object may
serve many layers and a wrapper (LoRA, docs/lora.md) can delegate to a base method without
copying its state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from shortconv.kernels.cpu_gemm import Q8Weight
from shortconv.kernels.cpu_gemm_q4 import Q4Weight
from shortconv.kernels.cpu_gemm_q6 import Q6Weight


@dataclass(frozen=True)
class PackedWeight:
    """A oneDNN-blocked copy of a weight and the weight's version counter when it was made: a
    later in-place change of the weight (version moves) makes the copy stale, and unused."""

    tensor: torch.Tensor
    version: int


class LinearLayer(Protocol):
    """What a method sees of its layer (layers.linear.LinearBase): the weight, and the slots
    where methods keep what they derive from it. A protocol, so the methods need not import
    the layers that hold them."""

    weight: torch.nn.Parameter
    blocked: PackedWeight | None
    q8: Q8Weight | None
    q4: Q4Weight | None
    q6: Q6Weight | None


class LinearMethod:
    """How one linear layer computes `x W^T + b`. `x` is [..., in_features] (the layer's
    local shard); the result is [..., out_features] in x's dtype."""

    #: A short name for the start-up log and tests ("float", "onednn", "cpu_gemm", "q8").
    name: str = "base"

    def process_after_load(self, layer: LinearLayer) -> None:
        """Turn the loaded float weight into this method's layout (once, on each rank, after
        its shard is loaded). The float layout needs nothing."""

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def onednn_weight(self, layer: LinearLayer, rows: int) -> torch.Tensor | None:
        """The weight oneDNN's inner product should read for a `rows`-row batch, where this
        method runs on oneDNN: lets SwiGLU fuse two layers' GEMMs. None elsewhere."""
        return None
