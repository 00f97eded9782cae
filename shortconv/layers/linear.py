"""Column-, row- and replicated linear layers whose parameters know how to take their shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shortconv.execution.parallel import ParallelContext
from shortconv.kernels.cpu_gemm import Q8Weight, gemm_f32, gemm_q8
from shortconv.layers.shard import load_shard_, mark_rows, mark_shard

__all__ = [
    "ColumnParallelLinear",
    "ColumnSliceLinear",
    "CpuGemm",
    "Packable",
    "ReplicatedLinear",
    "RowParallelLinear",
    "linear",
    "load_shard_",
    "mark_rows",
    "mark_shard",
    "prepack_linears",
    "silu_mul",
]

# Weights at least this large (elements) run through oneDNN's inner product on CPU: for fp32 it
# measured 1.2-3x faster than F.linear's default GEMM at decode batch sizes (1..128 rows) on the
# AVX-512 CPUs we run on, and no slower for prefill; below it oneDNN's per-call overhead (~15 us)
# costs more than it saves. Benchmarks set it to a huge value to measure the plain path.
ONEDNN_MIN_WEIGHT = 1 << 20
_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


# Rows from which SwiGLU fuses silu and the gate product into oneDNN's GEMMs (post-ops): 1.14x
# on the LFM2-350M MLP at 512 rows (prefill), a wash at decode sizes.
FUSED_SWIGLU_MIN_ROWS = 64

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


@dataclass(frozen=True)
class PackedWeight:
    """A oneDNN-blocked copy of a weight and the weight's version counter when it was made: a
    later in-place change of the weight (version moves) makes the copy stale, and unused."""

    tensor: torch.Tensor
    version: int


@dataclass(frozen=True)
class CpuGemm:
    """The layer's plain fp32 weight goes through our AVX2 kernel (kernels/cpu_gemm) for batches
    of up to `max_rows` rows, where it reads the weight faster than torch's paths; larger
    batches take oneDNN (on `blocked`, the prepacked copy, where one was made)."""

    max_rows: int
    blocked: PackedWeight | None = None


# Rows up to which fp32 linears take the AVX2 kernel (`CpuGemm`); oneDNN above. Measured on
# the 2-core AMD EPYC (AVX2) over LFM2-350M's MLP weights, 2 threads: 1.2-1.9x oneDNN at 1-16
# rows, 1.1x at 32, 1.04x at 64 and 128 (bench/RESULTS.md); past 64 rows (prefill) oneDNN's
# blocked GEMM is kept, since on AVX-512/AMX machines it is the faster one there.
CPU_GEMM_MAX_ROWS = 64

# What a layer may hold beside its weight: a oneDNN-blocked copy, the small-batch kernel's
# marker, or its quantized form (then the float weight is empty and the quantized one is the
# layer's only copy).
Packed = PackedWeight | CpuGemm | Q8Weight


def _onednn_weight(
    x: torch.Tensor, weight: torch.Tensor, packed: Packed | None
) -> torch.Tensor | None:
    """The weight to hand oneDNN's inner product for `x` (the blocked copy where it applies),
    or None where F.linear (or the quantized path) is the better or only one."""
    if isinstance(packed, Q8Weight):
        return None
    if isinstance(packed, CpuGemm):
        packed = packed.blocked
    if packed is None and weight.numel() < ONEDNN_MIN_WEIGHT:
        return None  # first: the common answer for small models, checked per call
    if not (
        _HAS_ONEDNN
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return None
    rows = x.numel() // max(1, x.shape[-1])
    if packed is not None and rows >= PACKED_MIN_ROWS and packed.version == weight._version:
        return packed.tensor
    return weight if weight.numel() >= ONEDNN_MIN_WEIGHT else None


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The blocked copy for the CPU fp32 oneDNN path, or None where that path does not apply
    (also for inference-mode tensors, which keep no version counter to detect staleness)."""
    if not (
        _HAS_ONEDNN
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.numel() >= PACK_MIN_WEIGHT
        and not weight.is_inference()
    ):
        return None
    blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)
    return PackedWeight(blocked, weight._version)


def silu_mul(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    p_gate: Packed | None = None,
    p_up: Packed | None = None,
) -> torch.Tensor:
    """silu(x w_gate^T) * (x w_up^T) for x [T, H]; both products and the gating in two oneDNN
    calls (swish and multiply post-ops) when that path applies and T is large enough."""
    if x.dim() == 2 and x.shape[0] >= FUSED_SWIGLU_MIN_ROWS:
        wg, wu = _onednn_weight(x, w_gate, p_gate), _onednn_weight(x, w_up, p_up)
        if wg is not None and wu is not None:
            gate = torch.ops.mkldnn._linear_pointwise(x, wg, None, "swish", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, gate, wu, None, "mul")
    return F.silu(linear(x, w_gate, None, p_gate)) * linear(x, w_up, None, p_up)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: Packed | None = None,
) -> torch.Tensor:
    """F.linear, or oneDNN's inner product for large fp32 CPU weights (same math, inference only:
    the oneDNN op has no autograd formula, so a grad-tracking call keeps F.linear); a blocked
    `packed` (see `prepack_linears`) is used for batches of PACKED_MIN_ROWS rows and more, a
    quantized one (layers.quantize) always."""
    if isinstance(packed, Q8Weight):
        return q8_linear(x, packed, bias)
    if isinstance(packed, CpuGemm) and x.numel() <= packed.max_rows * x.shape[-1]:
        if not (torch.is_grad_enabled() and weight.requires_grad):
            flat = x.reshape(-1, x.shape[-1])
            return gemm_f32(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
    w = _onednn_weight(x, weight, packed)
    if w is not None:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, w, bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def q8_linear(x: torch.Tensor, qw: Q8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T for a q8 weight, at every batch size through the AVX2 kernel: its int16 x int8
    sums measured faster than widening the weight to fp32 for oneDNN even at 256 rows (1.5x),
    and faster than fp32 oneDNN on the float weights (1.2-1.6x)."""
    flat = x.reshape(-1, x.shape[-1])
    y = gemm_q8(flat.float(), qw, bias)
    return y.to(x.dtype).view(*x.shape[:-1], qw.out_features)


class Packable(nn.Module):
    """A layer computing `linear(x, self.weight, ..., self.packed)`; `prepack_linears` fills
    `packed` once the weights are final."""

    weight: nn.Parameter
    packed: Packed | None = None


def prepack_linears(model: nn.Module) -> int:
    """Give every `Packable` layer of `model` a blocked copy of its weight where the CPU fp32
    oneDNN path applies; returns the bytes added (the plain weights stay: single-row batches,
    the embedding a tied LM head shares, and every non-CPU path use them). Opt-in: the copies
    double the weights' memory for a few percent at batch sizes of 8 and more."""
    added = 0
    for mod in model.modules():
        if isinstance(mod, Packable) and not isinstance(mod.packed, Q8Weight):
            blocked = pack_weight(mod.weight)
            if isinstance(mod.packed, CpuGemm):
                mod.packed = CpuGemm(mod.packed.max_rows, blocked)
            else:
                mod.packed = blocked
            if blocked is not None:
                added += mod.weight.numel() * mod.weight.element_size()
    return added


def use_cpu_gemm(model: nn.Module) -> int:
    """Mark every fp32 CPU `Packable` of `model` for the small-batch AVX2 kernel (call once its
    weights are final and the kernels are loaded: kernels.cpu_gemm.load); returns how many."""
    n = 0
    for mod in model.modules():
        if not (isinstance(mod, Packable) and mod.packed is None and mod.weight.numel()):
            continue
        if mod.weight.device.type == "cpu" and mod.weight.dtype == torch.float32:
            mod.packed = CpuGemm(CPU_GEMM_MAX_ROWS)
            n += 1
    return n


class ColumnParallelLinear(Packable):
    """y = x W^T (+ b); each rank holds out_features/tp rows (per packed part)."""

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: ParallelContext, parts: int = 1):
        super().__init__()
        out_local = tp.shard(out_f // parts, "output features") * parts
        self.weight = mark_shard(nn.Parameter(torch.empty(out_local, in_f)), 0, parts)
        self.bias = mark_shard(nn.Parameter(torch.empty(out_local)), 0, parts) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class RowParallelLinear(Packable):
    """y = all_reduce(x_shard W_shard^T) + b; each rank holds in_features/tp columns."""

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: ParallelContext):
        super().__init__()
        self.tp = tp
        self.weight = mark_shard(
            nn.Parameter(torch.empty(out_f, tp.shard(in_f, "input features"))), 1
        )
        self.bias = mark_shard(nn.Parameter(torch.empty(out_f)), None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed))
        # NOTE: bias after the reduction, so it is added once, not tp_size times.
        return y + self.bias if self.bias is not None else y


class ColumnSliceLinear(Packable):
    """y = x W[rows]^T (+ b[rows]): the output rows `rows` ([start, stop) ranges of the full
    weight, concatenated) that this rank needs, e.g. the KV heads its query heads use, which
    several ranks may hold alike (replicated) or which may be empty on a rank (ZAYA1's
    previous-token values live on the ranks holding those heads only)."""

    def __init__(self, in_f: int, rows: tuple[tuple[int, int], ...], bias: bool):
        super().__init__()
        n = sum(stop - start for start, stop in rows)
        self.weight = mark_rows(nn.Parameter(torch.empty(n, in_f)), 0, rows)
        self.bias = mark_rows(nn.Parameter(torch.empty(n)), 0, rows) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class ReplicatedLinear(Packable):
    def __init__(self, in_f: int, out_f: int, bias: bool):
        super().__init__()
        self.weight = mark_shard(nn.Parameter(torch.empty(out_f, in_f)), None)
        self.bias = mark_shard(nn.Parameter(torch.empty(out_f)), None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
