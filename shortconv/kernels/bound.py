"""The hot-path kernels of one device, chosen once when a layer is built.

`dispatch`'s entry points resolve the backend on every call (SHORTCONV_KERNELS read from
os.environ, the Triton module looked up): right for tests and tools, but a batch-1 CPU decode
step made ~100 such calls, a measurable share of its host time. A layer instead holds a
`BoundKernels` made by `bind_kernels` in its constructor, for the device it is built on (the
`torch.device(...)` context `models.build.build_model` opens, else the default device), so
SHORTCONV_KERNELS must be set before the model is built, and a model moved to another device
after build keeps its choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shortconv.kernels import dispatch

KernelFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class BoundKernels:
    """One backend's functions, each with its dispatch entry's (its `*_ref`'s) contract.

    backend: 'torch' or 'triton'; fused_verify: a verify step's short conv runs
    `verify_conv1d_cpu` (see `dispatch.fused_verify_conv`)."""

    backend: str
    causal_conv1d_fn: KernelFn
    causal_conv1d_update: KernelFn
    cca_conv_fn: KernelFn
    cca_conv_update: KernelFn
    fused_moe: KernelFn
    paged_attention: KernelFn
    fused_verify: bool


def _pick(
    device: torch.device, name: str, ref: KernelFn, module: str, cpu: KernelFn | None = None
) -> KernelFn:
    """`dispatch._pick` for the entry point `name`."""
    return dispatch._pick(device, f"{name}_triton", ref, module, cpu)


def bind_kernels(device: torch.device | str | None = None) -> BoundKernels:
    """The kernels for tensors on `device` (default: the current default device), under the
    SHORTCONV_KERNELS in force now."""
    dev = torch.device(device) if device is not None else torch.get_default_device()
    return BoundKernels(
        backend=dispatch.resolve_backend(dev),
        causal_conv1d_fn=_pick(
            dev,
            "causal_conv1d_fn",
            dispatch.causal_conv1d_fn_ref,
            "conv1d_triton",
            dispatch.causal_conv1d_fn_cpu,
        ),
        causal_conv1d_update=_pick(
            dev,
            "causal_conv1d_update",
            dispatch.causal_conv1d_update_ref,
            "conv1d_triton",
            dispatch.causal_conv1d_update_cpu,
        ),
        cca_conv_fn=_pick(dev, "cca_conv_fn", dispatch.cca_conv_fn_ref, "cca_triton"),
        cca_conv_update=_pick(
            dev,
            "cca_conv_update",
            dispatch.cca_conv_update_ref,
            "cca_triton",
            dispatch.cca_conv_update_cpu,
        ),
        fused_moe=_pick(dev, "fused_moe", dispatch.fused_moe_ref, "moe_triton"),
        paged_attention=dispatch.attention_backend(dev),
        fused_verify=dispatch.fused_verify_conv(dev),
    )
