"""Backend choice for the hot-path kernels: Triton on CUDA, the torch paths elsewhere.

The torch backend runs a kernel's CPU fast path (`*_cpu` modules) on CPU tensors where it has
one, and the `*_ref` oracle otherwise (and on any other device).

`SHORTCONV_KERNELS=torch|triton` forces one backend. The entry points here read it from
os.environ on every call, so kernel tests can flip it with monkeypatch.setenv; the layers bind
their kernels once, when they are built (`kernels.bound`), so for a model it must be set before
the model is built. `SHORTCONV_KERNELS=triton` on CPU tensors works under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from shortconv.kernels.attention_cpu import paged_attention_cpu
from shortconv.kernels.attention_ref import paged_attention_ref, write_kv_ref
from shortconv.kernels.attention_step import PagedAttentionStep
from shortconv.kernels.cca_cpu import cca_conv_update_cpu, cca_prev_value_update_cpu
from shortconv.kernels.cca_ref import (
    cca_conv_fn_ref,
    cca_conv_update_ref,
    cca_prev_value_fn_ref,
    cca_prev_value_update_ref,
)
from shortconv.kernels.conv1d_cpu import causal_conv1d_update_cpu
from shortconv.kernels.conv1d_ref import causal_conv1d_fn_ref, causal_conv1d_update_ref
from shortconv.kernels.conv1d_verify_cpu import causal_conv1d_fn_cpu
from shortconv.kernels.moe_ref import fused_moe_ref
from shortconv.kernels.scratch import StepScratch

ENV_VAR = "SHORTCONV_KERNELS"
_BACKENDS = ("torch", "triton")


def _triton_module(module: str = "conv1d_triton") -> ModuleType:
    """Import the Triton kernels (lazily: triton is an optional, dev/GPU-only dependency)."""
    try:
        return importlib.import_module(f"shortconv.kernels.{module}")
    except ImportError as exc:
        raise RuntimeError(
            f"{ENV_VAR}=triton (or a CUDA tensor) needs the triton package, which failed to "
            f"import ({exc}). Install it with `pip install triton==3.8.0` (part of the `dev` "
            f"extra), or set {ENV_VAR}=torch to use the pure-torch reference."
        ) from exc


def resolve_backend(device: torch.device) -> str:
    """'torch' or 'triton' for tensors on `device`, honouring SHORTCONV_KERNELS."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"{ENV_VAR} must be one of {_BACKENDS}, got {forced!r}")
        return forced
    return "triton" if device.type == "cuda" else "torch"


def _triton_or_none(device: torch.device, module: str) -> ModuleType | None:
    """The Triton module for tensors on `device`, or None when the torch path runs."""
    if resolve_backend(device) == "torch":
        return None
    try:
        return _triton_module(module)
    except RuntimeError as exc:
        if os.environ.get(ENV_VAR):
            raise  # explicitly asked for triton: never degrade silently
        # Default CUDA choice without triton installed: stay functional, but say so.
        warnings.warn(f"{exc} Falling back to the torch reference.", stacklevel=4)
        return None


def attention_context_buckets(
    device: torch.device, ladder: tuple[int, ...], max_model_len: int
) -> tuple[int, ...]:
    """The context buckets a captured decode step needs on `device`'s attention path.

    The torch path gathers each row's context densely (`[B, L]`, `attention_dense`), so it
    takes the ladder (at most 2x waste when it doubles). The paged Triton kernels read
    `block_tables` and bound each row's work by its own seq_lens, so one bucket, max_model_len,
    covers every decode step.
    """
    return ladder if _triton_or_none(device, "attention_triton") is None else (max_model_len,)


def _on_module(mod: ModuleType, name: str) -> Callable[..., torch.Tensor]:
    """`mod.name`, looked up at call time: tests count or replace Triton kernels on their
    module, after a layer has bound its kernels."""

    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        fn: Callable[..., torch.Tensor] = getattr(mod, name)
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def _pick(
    device: torch.device,
    name: str,
    ref: Callable[..., torch.Tensor],
    module: str = "conv1d_triton",
    cpu: Callable[..., torch.Tensor] | None = None,
) -> Callable[..., torch.Tensor]:
    """Triton's `module.name`, else the CPU fast path `cpu` for CPU tensors, else `ref`."""
    mod = _triton_or_none(device, module)
    if mod is not None:
        return _on_module(mod, name)
    return cpu if cpu is not None and device.type == "cpu" else ref


def _entry(
    name: str,
    ref: Callable[..., torch.Tensor],
    module: str,
    cpu: Callable[..., torch.Tensor] | None = None,
) -> Callable[..., torch.Tensor]:
    """The public entry point `name`: `ref`'s signature and contract (its docstring), running
    `_pick`'s choice for the device of the first argument (the input tensor x).

    NOTE: every backend of an entry takes the same arguments as its `*_ref` oracle, so one
    forwarding body serves them all; the Triton function is looked up on its module at call
    time (`name` + "_triton", `_on_module`), so tests can count or replace it there.
    """

    @functools.wraps(ref)
    def entry(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _pick(x.device, f"{name}_triton", ref, module, cpu)(x, *args, **kwargs)

    entry.__name__ = entry.__qualname__ = name
    return entry


# Varlen (prefill) and decode short conv, two-stage CCA conv (ZAYA1) and routed experts; see
# each `*_ref` for the contract (shapes, in-place state updates, pad rows).
causal_conv1d_fn = _entry(
    "causal_conv1d_fn", causal_conv1d_fn_ref, "conv1d_triton", causal_conv1d_fn_cpu
)
causal_conv1d_update = _entry(
    "causal_conv1d_update", causal_conv1d_update_ref, "conv1d_triton", causal_conv1d_update_cpu
)
cca_conv_fn = _entry("cca_conv_fn", cca_conv_fn_ref, "cca_triton")
cca_conv_update = _entry("cca_conv_update", cca_conv_update_ref, "cca_triton", cca_conv_update_cpu)
# The Triton path has static shapes and no host sync (CUDA-graph safe); the torch reference
# syncs. No tensor-parallel all-reduce.
fused_moe = _entry("fused_moe", fused_moe_ref, "moe_triton")


def fused_verify_conv(device: torch.device) -> bool:
    """Whether a verify step's short conv on `device` runs `conv1d_verify_cpu.verify_conv1d_cpu`
    (its checkpoints and state in one scatter): CPU tensors on the torch backend. Elsewhere the
    layer writes its checkpoints and runs `causal_conv1d_fn`."""
    return device.type == "cpu" and _triton_or_none(device, "conv1d_triton") is None


# NOTE: ZAYA1's previous-token value is a gather plus a row scatter with no arithmetic, which
# the torch reference already does graph-safely in a few launches; it has no Triton twin, so
# these names run the torch code on every backend: the prefill one the reference, the decode
# one its CPU fast path on CPU tensors (whatever SHORTCONV_KERNELS says) and the reference
# elsewhere.
cca_prev_value_fn = cca_prev_value_fn_ref


def cca_prev_value_update(
    v: torch.Tensor,
    prev_state: torch.Tensor,
    cache_indices: torch.Tensor,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Decode previous-token value; see `cca_ref.cca_prev_value_update_ref`.

    v [B, D], prev_state [n_slots, D] (v stored in place), cache_indices int [B]
    -> prev_state[slot] [B, D]. Pad rows get zero outputs and keep their state.
    """
    fn = cca_prev_value_update_cpu if v.device.type == "cpu" else cca_prev_value_update_ref
    return fn(v, prev_state, cache_indices, pad_slot_id)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: PagedAttentionStep,
    scale: float,
    scratch: StepScratch | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over their paged contexts.

    q [T, Hq, d] packed by `step.query_start_loc`; k_cache/v_cache [pages*page_size, Hk, d]
    flat page rows that already hold this step's K/V (`write_kv` first); Hq % Hk == 0
    -> out [T, Hq, d] in q's dtype. `window` (the layer's, a host int): 0 attends over the
    whole context; w > 0 lets the query at position p see positions p-w+1 .. p only (a
    sliding-window layer), and no backend reads a page wholly before a query chunk's first
    window, so those block-table entries may be scratch page 0 (freed pages).

    Triton backend (`paged_attention_triton`): the paged kernels read the pool in place
    through `step.block_tables` (decode kernel when every row has one query, the varlen extend
    kernel otherwise); no SDPA. Torch backend (`paged_attention_torch`): on CPU with
    `scratch` (the backend's reused buffers) the gathered fast path of `attention_cpu`,
    otherwise the padded SDPA reference; both derive their dense layout from the block tables
    (`attention_dense`).
    """
    if scratch is not None and q.device.type == "cpu" and k_cache.dtype == q.dtype:
        return paged_attention_cpu(q, k_cache, v_cache, step, scale, scratch, window)
    return paged_attention_ref(q, k_cache, v_cache, step, scale, scratch, window)


def attention_backend(device: torch.device) -> Callable[..., torch.Tensor]:
    """`paged_attention`'s implementation for tensors on `device`."""
    mod = _triton_or_none(device, "attention_triton")
    return paged_attention_torch if mod is None else functools.partial(paged_attention_triton, mod)


@functools.wraps(paged_attention_torch)
def paged_attention(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return attention_backend(q.device)(q, *args, **kwargs)


paged_attention.__name__ = paged_attention.__qualname__ = "paged_attention"


def paged_attention_triton(
    mod: ModuleType,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: PagedAttentionStep,
    scale: float,
    scratch: StepScratch | None = None,
    window: int = 0,
) -> torch.Tensor:
    """`paged_attention` on the Triton backend, its kernels on `mod` (`scratch` unused)."""
    # NOTE: the kernels are looked up on the module at call time (tests count them there).
    # Only host ints (max_query_len, page_size) and static shapes choose the kernel and its
    # grid, so graph capture sees no host sync.
    if step.max_query_len == 1:
        return mod.paged_attention_decode_triton(
            q,
            k_cache,
            v_cache,
            step.block_tables,
            step.seq_lens,
            scale,
            step.page_size,
            window=window,
        )
    return mod.paged_attention_extend_triton(
        q,
        k_cache,
        v_cache,
        step.block_tables,
        step.seq_lens,
        step.query_start_loc,
        scale,
        step.page_size,
        max_query_len=step.max_query_len,
        window=window,
    )


# NOTE: the KV write is one index_copy_ per cache (graph-safe, no arithmetic): no Triton twin.
write_kv = write_kv_ref
