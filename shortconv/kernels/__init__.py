"""Hot-path kernels (short conv, CCA conv, paged attention). Import the dispatching entry
points from here.

CUDA tensors run the Triton kernels, CPU tensors the torch paths (a `*_cpu` fast path where a
kernel has one, else its `*_ref` oracle); `SHORTCONV_KERNELS` (`torch` or `triton`) forces
one. See `dispatch` for details.
"""

from __future__ import annotations

from shortconv.kernels.dispatch import (
    attention_context_buckets,
    causal_conv1d_fn,
    causal_conv1d_update,
    cca_conv_fn,
    cca_conv_update,
    cca_prev_value_fn,
    cca_prev_value_update,
    fused_moe,
    fused_verify_conv,
    paged_attention,
    resolve_backend,
    write_kv,
)

__all__ = [
    "attention_context_buckets",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "cca_conv_fn",
    "cca_conv_update",
    "cca_prev_value_fn",
    "cca_prev_value_update",
    "paged_attention",
    "resolve_backend",
    "fused_moe",
    "fused_verify_conv",
    "write_kv",
]
