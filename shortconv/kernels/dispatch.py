"""Backend choice for the hot-path kernels: Triton on CUDA, the torch paths elsewhere.

The torch backend runs a kernel's CPU fast path (`*_cpu` modules) on CPU tensors where it has
one, and the `*_ref` oracle otherwise (and on any other device).

`SHORTCONV_KERNELS=torch|triton` forces one backend. It is read from os.environ on every call
(a dict lookup), so tests can flip it with monkeypatch.setenv and nothing needs resetting.
`SHORTCONV_KERNELS=triton` on CPU tensors works under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from shortconv.execution.step_tensors import StepScratch, StepTensors
from shortconv.kernels.attention_cpu import paged_attention_cpu
from shortconv.kernels.attention_ref import paged_attention_ref, write_kv_ref
from shortconv.kernels.cca_cpu import cca_conv_update_cpu, cca_prev_value_update_cpu
from shortconv.kernels.cca_ref import (
    cca_conv_fn_ref,
    cca_conv_update_ref,
    cca_prev_value_fn_ref,
    cca_prev_value_update_ref,
)
from shortconv.kernels.conv1d_cpu import causal_conv1d_update_cpu
from shortconv.kernels.conv1d_ref import causal_conv1d_fn_ref, causal_conv1d_update_ref
from shortconv.kernels.moe_ref import fused_moe_ref

ENV_VAR = "SHORTCONV_KERNELS"
_BACKENDS = ("torch", "triton")


def _triton_module(module: str = "conv1d_triton") -> ModuleType:
    """Import the Triton kernels (lazily: triton is an optional, dev/GPU-only dependency)."""
    try:
        return importlib.import_module(f"shortconv.kernels.{module}")
    except ImportError as exc:
        raise RuntimeError(
            f"{ENV_VAR}=triton (or a CUDA tensor) needs the triton package, which failed to "
            f"import ({exc}). Install it with `pip install triton==3.6.0` (part of the `dev` "
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
        return getattr(mod, name)
    return cpu if cpu is not None and device.type == "cpu" else ref


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    pad_slot_id: int = -1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen (prefill) short conv; see `conv1d_ref.causal_conv1d_fn_ref` for the contract.

    x [dim, T], weight [dim, W], bias [dim] | None, conv_states [n_slots, dim, W-1] (updated in
    place), query_start_loc int [B+1], cache_indices int [B], has_initial_state bool [B]
    -> out [dim, T]. Pad rows get zero outputs and keep their state.
    """
    fn = _pick(x.device, "causal_conv1d_fn_triton", causal_conv1d_fn_ref)
    return fn(
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        pad_slot_id,
        out=out,
    )


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state_indices: torch.Tensor,
    pad_slot_id: int = -1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode short conv, one token per row; see `conv1d_ref.causal_conv1d_update_ref`.

    x [B, dim], conv_state [n_slots, dim, W-1] (shifted in place), weight [dim, W],
    bias [dim] | None, conv_state_indices int [B] -> out [B, dim]. Pad rows get zero outputs
    and keep their state.
    """
    fn = _pick(
        x.device,
        "causal_conv1d_update_triton",
        causal_conv1d_update_ref,
        cpu=causal_conv1d_update_cpu,
    )
    return fn(x, conv_state, weight, bias, conv_state_indices, pad_slot_id, out=out)


def cca_conv_fn(
    x: torch.Tensor,
    w0: torch.Tensor,
    b0: torch.Tensor | None,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    pad_slot_id: int = -1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen two-stage CCA conv (ZAYA1 prefill); see `cca_ref.cca_conv_fn_ref`.

    x [C, T] raw q‖k, w0 [C, t0], b0 [C] | None, w1 [C, g, t1], b1 [C] | None,
    conv_states [n_slots, C, (t0-1)+(t1-1)] (updated in place), query_start_loc int [B+1],
    cache_indices int [B], has_initial_state bool [B] -> out [C, T]. Pad rows get zero
    outputs and keep their state.
    """
    fn = _pick(x.device, "cca_conv_fn_triton", cca_conv_fn_ref, "cca_triton")
    return fn(
        x,
        w0,
        b0,
        w1,
        b1,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        pad_slot_id,
        out=out,
    )


def cca_conv_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    w0: torch.Tensor,
    b0: torch.Tensor | None,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    cache_indices: torch.Tensor,
    pad_slot_id: int = -1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode two-stage CCA conv, one token per row; see `cca_ref.cca_conv_update_ref`.

    x [B, C], conv_states [n_slots, C, K] (shifted in place), weights as in `cca_conv_fn`,
    cache_indices int [B] -> out [B, C]. Pad rows get zero outputs and keep their state.
    """
    fn = _pick(
        x.device,
        "cca_conv_update_triton",
        cca_conv_update_ref,
        "cca_triton",
        cpu=cca_conv_update_cpu,
    )
    return fn(x, conv_states, w0, b0, w1, b1, cache_indices, pad_slot_id, out=out)


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


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts (SwiGLU-style); see `moe_ref.fused_moe_ref` for the contract.

    x [T, H], gate_up [E, 2I, H] (gate ‖ up), down [E, H, I], ids int [T, k] (E = skip route),
    weights [T, k], activation in {"silu", "gelu", "gelu_tanh", "relu"} -> out [T, H] in x's
    dtype. The Triton path has static shapes and no host sync (CUDA-graph safe); the torch
    reference syncs. No tensor-parallel all-reduce.
    """
    fn = _pick(x.device, "fused_moe_triton", fused_moe_ref, "moe_triton")
    if fn is fused_moe_ref:
        result = fused_moe_ref(x, gate_up, down, ids, weights, activation)
        return result if out is None else out.copy_(result)
    return fn(x, gate_up, down, ids, weights, activation, out=out)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: StepTensors,
    scale: float,
    scratch: StepScratch | None = None,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over their paged contexts.

    q [T, Hq, d] packed by `step.query_start_loc`; k_cache/v_cache [pages*page_size, Hk, d]
    flat page rows that already hold this step's K/V (`write_kv` first); Hq % Hk == 0
    -> out [T, Hq, d] in q's dtype.

    Triton backend: the paged kernels read the pool in place through `step.block_tables`
    (decode kernel when every row has one query, the varlen extend kernel otherwise); no SDPA.
    Torch backend: on CPU with `scratch` (the backend's reused buffers) the gathered fast path
    of `attention_cpu`, otherwise the padded SDPA reference; both derive their dense layout
    from the block tables (`attention_dense`).
    """
    mod = _triton_or_none(q.device, "attention_triton")
    if mod is not None:
        return _paged_attention_triton(mod, q, k_cache, v_cache, step, scale)
    if scratch is not None and q.device.type == "cpu" and k_cache.dtype == q.dtype:
        return paged_attention_cpu(q, k_cache, v_cache, step, scale, scratch)
    return paged_attention_ref(q, k_cache, v_cache, step, scale, scratch)


def _paged_attention_triton(
    mod: ModuleType,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: StepTensors,
    scale: float,
) -> torch.Tensor:
    # NOTE: the kernels are looked up on the module at call time (tests count them there).
    # Only host ints (max_query_len, page_size) and static shapes choose the kernel and its
    # grid, so graph capture sees no host sync.
    if step.max_query_len == 1:
        return mod.paged_attention_decode_triton(
            q, k_cache, v_cache, step.block_tables, step.seq_lens, scale, step.page_size
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
    )


# NOTE: the KV write is one index_copy_ per cache (graph-safe, no arithmetic): no Triton twin.
write_kv = write_kv_ref
