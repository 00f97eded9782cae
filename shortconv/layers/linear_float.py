"""Float linear methods: torch's F.linear, and oneDNN's inner product for CPU fp32 weights
(plain, or from a prepacked blocked copy made after load)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shortconv.layers.linear_method import LinearLayer, LinearMethod, PackedWeight

# Weights at least this large (elements) run through oneDNN's inner product on CPU: for fp32 it
# measured 1.2-3x faster than F.linear's default GEMM at decode batch sizes (1..128 rows) on the
# AVX-512 CPUs we run on, and no slower for prefill; below it oneDNN's per-call overhead (~15 us)
# costs more than it saves. Read when methods are bound (build), so a benchmark that sets it
# huge before building measures the plain path.
ONEDNN_MIN_WEIGHT = 1 << 20
HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

# Rows from which a layer's prepacked (oneDNN-blocked) weight, where one was made (opt-in:
# EngineConfig.prepack_cpu_weights), is used instead of the plain one. On LFM2-350M-sized
# weights (one thread, AVX-512) the blocked copy was 0-13% faster than oneDNN on the plain
# weight at 32 rows but 1.2-2x slower at one row, so single rows keep the plain weight; the
# default keeps no copy at all (one copy of the weights in memory). oneDNN picks the blocking
# for _PACK_ROWS rows (32 and 512 measured alike).
PACKED_MIN_ROWS = 8
_PACK_ROWS = 32

# Weights from this size (elements) get a blocked copy too, used only from PACKED_MIN_ROWS rows:
# between here and ONEDNN_MIN_WEIGHT (e.g. LFM2-350M's 512x1024 K/V projections) the blocked
# copy measured 1.3-2.6x faster than F.linear at 8..64 rows, while plain oneDNN at one row was
# no faster or slower (a 256x1024 weight: 25 vs 20 us), so single rows keep F.linear there.
PACK_MIN_WEIGHT = 1 << 18


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The blocked copy for the CPU fp32 oneDNN path, or None where that path does not apply
    (also for inference-mode tensors, which keep no version counter to detect staleness)."""
    if not (
        HAS_ONEDNN
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.numel() >= PACK_MIN_WEIGHT
        and not weight.is_inference()
    ):
        return None
    blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)
    return PackedWeight(blocked, weight._version)


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] through oneDNN's inner product with `w` (plain [out, in] or blocked)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, w, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


@dataclass(frozen=True)
class FloatLinear(LinearMethod):
    """F.linear on the float weight: every device and dtype (the GPU path, bf16, small CPU
    weights, a layer with an empty shard)."""

    name: str = "float"

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


@dataclass(frozen=True)
class OneDnnLinear(LinearMethod):
    """A CPU fp32 inference weight through oneDNN: the plain weight where `plain` (large
    weights), the blocked copy from PACKED_MIN_ROWS rows where `prepack` made one, F.linear
    otherwise (mid-size weights at small batches)."""

    plain: bool
    prepack: bool
    name: str = "onednn"

    def process_after_load(self, layer: LinearLayer) -> None:
        layer.blocked = pack_weight(layer.weight) if self.prepack else None

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self.onednn_weight(layer, x.numel() // max(1, x.shape[-1]))
        return F.linear(x, layer.weight, bias) if w is None else onednn_linear(x, w, bias)

    def onednn_weight(self, layer: LinearLayer, rows: int) -> torch.Tensor | None:
        blocked = layer.blocked
        if blocked is not None and rows >= PACKED_MIN_ROWS:
            if blocked.version == layer.weight._version:
                return blocked.tensor
        return layer.weight if self.plain else None


FLOAT = FloatLinear()


def cpu_float_method(weight: torch.Tensor, prepack: bool) -> LinearMethod:
    """The float method for an fp32 CPU inference weight (chosen at build): oneDNN where it
    pays (large weights, or a blocked copy asked for and large enough to pay), else F.linear."""
    plain = HAS_ONEDNN and weight.numel() >= ONEDNN_MIN_WEIGHT
    packs = prepack and HAS_ONEDNN and weight.numel() >= PACK_MIN_WEIGHT
    return OneDnnLinear(plain, packs) if plain or packs else FLOAT


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T for a bare weight that is no linear layer (an expert's slice of a fused tensor,
    the benchmarks): oneDNN for a large fp32 CPU inference weight, as OneDnnLinear, else
    F.linear."""
    if (
        HAS_ONEDNN
        and w.device.type == "cpu"
        and x.dtype == w.dtype == torch.float32
        and w.numel() >= ONEDNN_MIN_WEIGHT
        and not (torch.is_grad_enabled() and w.requires_grad)
    ):
        return onednn_linear(x, w, None)
    return F.linear(x, w)
