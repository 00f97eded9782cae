"""Force the GPU (Triton) path on CPU for an end-to-end test, and prove it was taken.

`force_triton_path(monkeypatch)` sets `SHORTCONV_KERNELS=triton` + `TRITON_INTERPRET=1`, counts
the Triton attention and fused-MoE kernels, and makes torch's SDPA, the torch expert paths and
the torch attention path's dense layout (gather and mask) raise: an oracle that needs SDPA must
run before, or lift the patch around itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shortconv.kernels.bound import BoundKernels, bind_kernels


def _counting(calls: Counter[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def _forbidden(name: str) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} called under SHORTCONV_KERNELS=triton")

    return fail


def force_triton_path(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The counters of the Triton kernels called from now on (see the module docstring)."""
    from shortconv.kernels import attention_dense, attention_triton, lora_triton, moe_triton
    from shortconv.layers.experts import FusedExperts

    monkeypatch.setenv("SHORTCONV_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls: Counter[str] = Counter()
    counted = [
        (attention_triton, "paged_attention_decode_triton"),
        (attention_triton, "paged_attention_extend_triton"),
        (moe_triton, "fused_moe_triton"),
        (lora_triton, "lora_delta_triton"),
    ]
    for name in ("_expert", "_padded", "_forward_dense"):  # the torch expert paths
        monkeypatch.setattr(FusedExperts, name, _forbidden(f"FusedExperts.{name}"))
    # The [B, L] gather and [B, Q, L] mask (full or windowed), derived by the torch path only.
    for name in ("_build", "_build_windowed"):
        monkeypatch.setattr(attention_dense, name, _forbidden(f"attention_dense.{name}"))
    for mod, name in counted:
        monkeypatch.setattr(mod, name, _counting(calls, name, getattr(mod, name)))
    monkeypatch.setattr(F, "scaled_dot_product_attention", _forbidden("torch SDPA"))
    return calls


def rebind_kernels(model: nn.Module, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Give every layer of an already built `model` the kernels SHORTCONV_KERNELS names now, as
    a model built now would have (layers bind theirs at build: `kernels.bound`); monkeypatch
    restores the old ones."""
    for m in model.modules():
        if isinstance(getattr(m, "kernels", None), BoundKernels):
            monkeypatch.setattr(m, "kernels", bind_kernels(device))
