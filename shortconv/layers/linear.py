"""Column-, row- and replicated linear layers whose parameters know how to take their shard."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shortconv.config import CheckpointError
from shortconv.parallel import ParallelContext

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


def _use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        _HAS_ONEDNN
        and weight.numel() >= ONEDNN_MIN_WEIGHT
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and weight.requires_grad)
    )


def silu_mul(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """silu(x w_gate^T) * (x w_up^T) for x [T, H]; both products and the gating in two oneDNN
    calls (swish and multiply post-ops) when that path applies and T is large enough."""
    if x.dim() == 2 and x.shape[0] >= FUSED_SWIGLU_MIN_ROWS and _use_onednn(x, w_gate):
        gate = torch.ops.mkldnn._linear_pointwise(x, w_gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, w_up, None, "mul")
    return F.silu(linear(x, w_gate)) * linear(x, w_up)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or oneDNN's inner product for large fp32 CPU weights (same math, inference only:
    the oneDNN op has no autograd formula, so a grad-tracking call keeps F.linear)."""
    if _use_onednn(x, weight):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def mark_shard(param: nn.Parameter, dim: int | None, parts: int = 1) -> nn.Parameter:
    """Record how the full checkpoint tensor maps onto this rank's parameter.

    dim=None: replicated. `parts` > 1: the full tensor packs `parts` equal blocks along `dim`
    (e.g. LFM2's in_proj = B‖C‖x) and each block is split separately.
    """
    param.shard_dim = dim  # type: ignore[attr-defined]
    param.shard_parts = parts  # type: ignore[attr-defined]
    return param


def load_shard_(param: nn.Parameter, full: torch.Tensor, tp: ParallelContext, name: str) -> None:
    """Copy this rank's block of `full` into `param`, with a clear error on any shape mismatch."""
    dim = getattr(param, "shard_dim", None)
    parts = getattr(param, "shard_parts", 1)
    t = full
    if dim is not None and tp.size > 1:
        blocks = t.chunk(parts, dim=dim)
        t = torch.cat([b.chunk(tp.size, dim=dim)[tp.rank] for b in blocks], dim=dim)
    if t.shape != param.shape:
        raise CheckpointError(
            f"checkpoint tensor {name!r} has shape {tuple(full.shape)}, expected "
            f"{_full_shape(param, tp)} for this model config"
        )
    with torch.no_grad():
        param.copy_(t.to(param.dtype))


def _full_shape(param: nn.Parameter, tp: ParallelContext) -> tuple[int, ...]:
    dim = getattr(param, "shard_dim", None)
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= tp.size
    return tuple(shape)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b); each rank holds out_features/tp rows (per packed part)."""

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: ParallelContext, parts: int = 1):
        super().__init__()
        out_local = tp.shard(out_f // parts, "output features") * parts
        self.weight = mark_shard(nn.Parameter(torch.empty(out_local, in_f)), 0, parts)
        self.bias = mark_shard(nn.Parameter(torch.empty(out_local)), 0, parts) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b; each rank holds in_features/tp columns."""

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: ParallelContext):
        super().__init__()
        self.tp = tp
        self.weight = mark_shard(
            nn.Parameter(torch.empty(out_f, tp.shard(in_f, "input features"))), 1
        )
        self.bias = mark_shard(nn.Parameter(torch.empty(out_f)), None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight))
        # NOTE: bias after the reduction, so it is added once, not tp_size times.
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(nn.Module):
    def __init__(self, in_f: int, out_f: int, bias: bool):
        super().__init__()
        self.weight = mark_shard(nn.Parameter(torch.empty(out_f, in_f)), None)
        self.bias = mark_shard(nn.Parameter(torch.empty(out_f)), None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
