"""int8 linear on CPU: per-output-channel int8 weights, per-token int8 activations (W8A8).

The product runs in fbgemm (torch's own packed-weight op,
`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`): int8 x uint8 products summed in
int32, then scaled to fp32. Measured on the 2-core AMD EPYC (AVX2, no AVX-512) over 453 MB of
fp32 weights (past the caches), one 4608 x 1024 weight, 2 threads: 0.28 ms against fp32's
0.83 ms through oneDNN at one row (3.0x), 0.45 vs 1.85 ms at 8 rows, 1.29 vs 3.74 ms at 32.
torch's weight-only `_weight_int8pack_mm` measured 2.9x *slower* than fp32 at one row, and
`_int_mm` slower still; torchao's int8 weight-only layout 2x slower than fp32.

Activations: fbgemm quantizes its input with one scale for the whole tensor. Each row is first
divided by its own largest magnitude, so every row spans at most [-1, 1] and the op's fixed input
scale quantizes each row exactly as it would alone: a request's result does not depend on what
else is in the batch. The row's magnitude multiplies the output back. The input uses 7 bits
(uint8 in [1, 127], zero point 64), as fbgemm's own x86 default (`reduce_range`) does: on AVX2
its u8 x s8 products are summed in pairs into int16 (`vpmaddubsw`), which saturates for inputs
near 255 (measured: 0.47 off the exact sum with zero point 128, 5e-7 with 64).

Seven bits of activation cost more than the int8 weights do: on the tiny LFM2 the mean
teacher-forced KL was 5.8e-2 with them against 7.4e-3 with the weights alone quantized. So each
row goes in twice, stacked into one call: the row, and its rounding residual rescaled to its own
largest magnitude (the sum of the two is ~14 bits). One call reads the weight once, so at decode
batch sizes, where reading the weight is the cost, the second row is nearly free; the residual's
KL on the tiny LFM2 was 7.9e-3, the weights' own floor.

Plain tensors in, plain tensors out; `int8_linear_ref` is the oracle (float64 sums of the same
integers, exact).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

X_SCALE = 1.0 / 63  # input scale after each row is divided by its largest magnitude
X_ZERO_POINT = 64  # uint8 input: q = round(x * 63) + 64, in [1, 127] (see the docstring)
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row divides by this, not by 0


@dataclass(frozen=True)
class Int8Weight:
    """A linear weight [out, in] quantized per output row: `packed` is fbgemm's prepacked copy
    (the only copy kept), `scale` [out] fp32 its row scales."""

    packed: torch.ScriptObject
    scale: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features + self.scale.numel() * 4

    def unpacked(self) -> torch.Tensor:
        """The int8 weight [out, in] (for the ref and tests; a copy)."""
        qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return qweight.int_repr()


def row_amax(weight: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude (fp32), what `quantize_int8`'s scales derive from."""
    return weight.detach().float().abs().amax(dim=1)


def quantize_int8(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 row scales): symmetric, scale = the row's largest magnitude / 127.
    `amax` replaces the rows' own magnitudes (a shard quantized with its whole rows' scales)."""
    w = weight.detach().float()
    scale = ((row_amax(w) if amax is None else amax.float()) / 127).clamp_min(_TINY)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_int8(qweight: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
    """fbgemm's prepacked form of an int8 weight and its row scales."""
    out_f, in_f = qweight.shape
    with warnings.catch_warnings():
        # torch marks quantized-tensor creation deprecated (in favour of torchao); fbgemm's
        # packed linear, which needs one as its input, is still the fastest int8 path here.
        warnings.simplefilter("ignore", UserWarning)
        q = torch._make_per_channel_quantized_tensor(
            qweight, scale.double(), torch.zeros(out_f, dtype=torch.long), 0
        )
    packed = torch.ops.quantized.linear_prepack(q, None)
    return Int8Weight(packed, scale.float().clone(), out_f, in_f)


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(dim=-1, keepdim=True).clamp_min_(_TINY)


def int8_linear(
    x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] (any float dtype) @ weight^T (+ bias) -> [..., out] in x's dtype."""
    flat = x.reshape(-1, weight.in_features).float()
    rows = flat.shape[0]
    norms = _row_norms(flat)
    unit = flat / norms
    residual = unit - torch.round(unit / X_SCALE) * X_SCALE
    res_norms = _row_norms(residual)
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        torch.cat([unit, residual / res_norms]), X_SCALE, X_ZERO_POINT, weight.packed
    )
    y = torch.addcmul(y[:rows], y[rows:], res_norms).mul_(norms)
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)


def int8_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle of `int8_linear`: the same two quantized parts of each row, the integer
    products summed in float64 (exact at these sizes), scaled back."""
    flat = x.reshape(-1, qweight.shape[1]).float()
    norms = _row_norms(flat)
    unit = flat / norms
    hi = torch.clamp(torch.round(unit / X_SCALE), -63, 63)
    residual = unit - hi * X_SCALE
    res_norms = _row_norms(residual)
    lo = torch.clamp(torch.round(residual / res_norms / X_SCALE), -63, 63)
    w = qweight.double().t()
    acc = (hi.double() @ w) + (lo.double() @ w) * res_norms.double()
    y = (acc * X_SCALE * scale.double()[None, :] * norms.double()).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], qweight.shape[0])
