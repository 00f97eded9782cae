"""Construct a model directly in its serving dtype on its device (no fp32 copy first)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from shortconv.configs.config import ModelConfig
from shortconv.execution.parallel import ParallelContext
from shortconv.layers.linear_binding import TORCH_LINEARS, LinearPolicy, bind_linear_methods
from shortconv.layers.norm import bind_rms_norms


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Floating tensors created without an explicit dtype get `dtype` inside the block.

    Why: building a model under this (and `torch.device`) allocates its weights once, in the
    target dtype on the target device; building in fp32 and casting afterwards needs the fp32
    copy as a transient (about 34 GB at ZAYA1-8B's shape)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def build_model(
    cls: type[ModuleT],
    cfg: ModelConfig,
    tp: ParallelContext,
    device: torch.device | str,
    dtype: torch.dtype,
    linears: LinearPolicy = TORCH_LINEARS,
) -> ModuleT:
    """`cls(cfg, tp)` allocated in `dtype` on `device`, inference-only (no autograd), each
    linear layer bound to its method by `linears` (its weights still to load), and each
    RMSNorm to our fused CPU kernel where `linears.cpu_gemm` (our kernels loaded and wanted)
    and it is fp32 on CPU.

    NOTE: the final `.to(dtype)` still converts the few tensors created explicitly in fp32
    (router biases, rotary tables): the engine serves everything in one dtype."""
    with torch.device(device), default_dtype(dtype):
        model = cls(cfg, tp)
    model = model.to(dtype=dtype).requires_grad_(False).eval()
    bind_linear_methods(model, linears)
    bind_rms_norms(model, linears.cpu_gemm)
    return model
