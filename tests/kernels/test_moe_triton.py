"""Triton fused MoE against its torch oracle, and the oracle against a dense computation.

Runs under Triton's interpreter on CPU (TRITON_INTERPRET set per test; moe_triton jits lazily
once per mode). The dense check runs every expert on every token in fp64 and combines with a
[T, E] weight matrix, independent of the oracle's per-expert gather. Shapes are small so each
test stays well under a few seconds in the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from torch import nn
from triton_path import rebind_kernels

pytest.importorskip("triton")

from shortconv.configs.config import ModelConfig  # noqa: E402
from shortconv.execution.parallel import ParallelContext  # noqa: E402
from shortconv.kernels import moe_triton  # noqa: E402
from shortconv.kernels.moe_align import align_routes, padded_length  # noqa: E402
from shortconv.kernels.moe_ref import fused_moe_ref  # noqa: E402
from shortconv.kernels.moe_triton import block_m_for, fused_moe_triton  # noqa: E402
from shortconv.layers.moe import SigmoidTopKMoE  # noqa: E402
from shortconv.layers.zaya_moe import ZayaMoE  # noqa: E402
from shortconv.tiny.checkpoint import TINY_PRESETS  # noqa: E402

ACTS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
    "relu": torch.relu,
}
# (atol, rtol) against the fp64 dense result and the oracle. The kernel accumulates in fp32 and
# rounds only the intermediate act(gate) * up and the per-route rows; the oracle rounds every
# matmul output to the dtype, so the two differ by a few ulps of the dtype at |y| ~ 1.
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _dense(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """Every expert on every token in fp64; the skip id E lands in a dropped combine column."""
    e, two_i, _ = gate_up.shape
    i = two_i // 2
    h = torch.einsum("th,eoh->teo", x.double(), gate_up.double())
    inner = ACTS[act](h[..., :i]) * h[..., i:]
    y = torch.einsum("tei,ehi->teh", inner, down.double())
    combine = torch.zeros(x.shape[0], e + 1, dtype=torch.float64)
    combine.scatter_add_(1, ids.long(), weights.double())
    return (combine[:, :e, None] * y).sum(1)


def _case(
    t: int, k: int, e: int, hid: int, inter: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hid, generator=g).to(dtype)
    gate_up = (torch.randn(e, 2 * inter, hid, generator=g) / hid**0.5).to(dtype)
    down = (torch.randn(e, hid, inter, generator=g) / inter**0.5).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, generator=g)
    return x, gate_up, down, ids, weights


def _check(
    got: torch.Tensor,
    x: torch.Tensor,
    gu: torch.Tensor,
    dn: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    act: str,
) -> None:
    """Oracle vs dense, then kernel vs oracle and vs dense, at the dtype's tolerance."""
    atol, rtol = TOL[x.dtype]
    assert got.dtype == x.dtype and got.shape == x.shape
    dense = _dense(x, gu, dn, ids, w, act).float()
    ref = fused_moe_ref(x, gu, dn, ids, w, act)
    torch.testing.assert_close(ref.float(), dense, atol=atol, rtol=rtol)
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(got.float(), dense, atol=atol, rtol=rtol)


CASES = {
    "top1": dict(t=7, k=1, e=4),
    "top2": dict(t=19, k=2, e=5),
}


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("name", list(CASES))
def test_triton_and_ref_match_dense_fp32(name: str, act: str) -> None:
    x, gu, dn, ids, w = _case(**CASES[name], hid=40, inter=24, dtype=torch.float32)
    _check(fused_moe_triton(x, gu, dn, ids, w, act), x, gu, dn, ids, w, act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_dtypes(name: str, dtype: torch.dtype) -> None:
    # Shapes not multiples of the 64-wide N/K tiles, so the masked tails are exercised too.
    x, gu, dn, ids, w = _case(**CASES[name], hid=72, inter=20, dtype=dtype, seed=1)
    _check(fused_moe_triton(x, gu, dn, ids, w, "silu"), x, gu, dn, ids, w, "silu")


def _edge_routes(variant: str, ids: torch.Tensor, w: torch.Tensor, e: int):
    """Routing edge cases on a [T, 2] case with e experts (ids == e is ZAYA1's skip route)."""
    ids, w = ids.clone(), w.clone()
    if variant == "one_expert_top1":  # every token on one expert; sliced (strided) ids/weights
        return torch.full_like(ids, 3)[:, :1], w[:, :1]
    if variant == "one_expert_top2":  # every token on the same two experts, 4 of 6 idle
        ids[:, 0], ids[:, 1] = 3, 1
    elif variant == "idle_experts":  # experts 2.. get no tokens
        ids = ids % 2
        ids[:, 1] = 1 - ids[:, 0]
    elif variant == "some_skip":
        ids[::2, 0] = e
        ids[1::4, :] = e  # some tokens skip both routes: their rows must be exactly zero
    elif variant == "all_skip":
        ids[:] = e
    elif variant == "zero_w":
        w[::3] = 0.0
        w[1::3, 1] = 0.0
    else:
        raise AssertionError(variant)
    return ids, w


EDGE_VARIANTS = [
    "one_expert_top1",
    "one_expert_top2",
    "idle_experts",
    "some_skip",
    "all_skip",
    "zero_w",
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", EDGE_VARIANTS)
def test_routing_edge_cases(variant: str, dtype: torch.dtype) -> None:
    e = 6
    x, gu, dn, ids, w = _case(t=13, k=2, e=e, hid=70, inter=33, dtype=dtype)
    ids, w = _edge_routes(variant, ids, w, e)
    got = fused_moe_triton(x, gu, dn, ids, w, "silu")
    _check(got, x, gu, dn, ids, w, "silu")
    dead = ((ids == e) | (w == 0)).all(dim=1)  # tokens with no live route
    assert torch.equal(got[dead], torch.zeros_like(got[dead]))


@pytest.mark.parametrize("variant", ["some_skip", "all_skip", "zero_w", "idle_experts"])
def test_skip_and_zero_weight_routes_get_no_gemm_slot(variant: str) -> None:
    """Skip routes (id == E) and zero-weight routes land in no block, so they cost no GEMM work;
    blocks of experts without routes are marked -1 and return before any weight read."""
    e, block_m = 6, 16
    _, _, _, ids, w = _case(t=13, k=2, e=e, hid=8, inter=8, dtype=torch.float32)
    ids, w = _edge_routes(variant, ids, w, e)
    al = align_routes(ids, w, e, block_m)
    live = ((ids < e) & (w != 0)).reshape(-1)
    slots = al.sorted_route_ids.long()
    placed = slots[slots < ids.numel()]
    assert sorted(placed.tolist()) == live.nonzero().squeeze(1).tolist()  # each live route once
    per_expert = torch.bincount(ids.reshape(-1)[live].long(), minlength=e)
    used_blocks = int(((per_expert + block_m - 1) // block_m).sum())
    assert int(al.num_used_blocks) == used_blocks
    blocks = al.expert_of_block.long()
    assert (blocks[:used_blocks] >= 0).all() and (blocks[used_blocks:] == -1).all()
    # Every used block belongs to an expert that has routes: idle experts have no block.
    assert set(blocks[:used_blocks].tolist()) == set(per_expert.nonzero().squeeze(1).tolist())
    # Each slot of a used block holds a route of that block's expert (or the padding sentinel).
    slot_expert = blocks.repeat_interleave(block_m)
    routed = slots < ids.numel()
    assert torch.equal(ids.reshape(-1).long()[slots[routed]], slot_expert[routed])


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_out_is_written_over_nan_poison(dtype: torch.dtype, ids_dtype: torch.dtype) -> None:
    """`out=` starts as NaN: every row must be overwritten, skip-only rows with zeros, and the
    result is `out` itself. `out` is a strided view and x a non-contiguous slice."""
    e = 5
    x, gu, dn, ids, w = _case(t=10, k=2, e=e, hid=48, inter=24, dtype=dtype, seed=3)
    x = torch.cat([x, x], dim=1)[:, ::2]  # same values, column stride 2
    ids = ids.to(ids_dtype)
    ids[::3, :] = e  # whole tokens on the skip route
    ids[1, 1] = e
    backing = torch.full((10, 2 * 48), float("nan"), dtype=dtype)
    out = backing[:, 48:]
    got = fused_moe_triton(x, gu, dn, ids, w, "silu", out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any()
    assert torch.isnan(backing[:, :48]).all()  # nothing written outside `out`
    _check(out, x, gu, dn, ids, w, "silu")


class _NoLaunch:
    """Stands in for a jitted kernel: `kernel[grid](...)` records the grid and does nothing."""

    def __init__(self, grids: list[tuple[int, ...]]) -> None:
        self.grids = grids

    def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


@pytest.mark.parametrize(("t", "k", "e"), [(1, 1, 4), (8, 2, 6), (32, 1, 16), (64, 2, 8)])
def test_host_side_is_static_shape_and_sync_free(
    t: int, k: int, e: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA-graph safety of everything around the kernels: on the meta device any host read of
    routing data (.item(), .tolist(), nonzero, bincount, data-dependent shapes) raises, so the
    wrapper running there proves the sort and the combine never sync. The launch grids and
    buffer sizes depend only on (T, k, E, BLOCK_M)."""
    grids: list[tuple[int, ...]] = []
    monkeypatch.setattr(moe_triton, "_kernels", lambda: (_NoLaunch(grids), _NoLaunch(grids)))
    hid, inter = 32, 16
    meta = dict(device="meta")
    x = torch.empty(t, hid, **meta)
    gu = torch.empty(e, 2 * inter, hid, **meta)
    dn = torch.empty(e, hid, inter, **meta)
    ids = torch.empty(t, k, dtype=torch.int64, **meta)
    w = torch.empty(t, k, **meta)
    out = torch.empty(t, hid, **meta)
    assert fused_moe_triton(x, gu, dn, ids, w, "silu", out=out) is out
    bm = block_m_for(t * k, e)
    blocks = padded_length(t * k, e, bm) // bm
    assert grids == [
        (blocks, -(-inter // moe_triton.BLOCK_N)),
        (blocks, -(-hid // moe_triton.BLOCK_N)),
    ]


def test_alignment_shapes_depend_only_on_static_sizes() -> None:
    # NOTE: capture safety — output shapes must not depend on the routing values: random ids,
    # all on one expert, all skipped, and all zero-weight routings give the same shapes.
    t, k, e, bm = 9, 2, 4, 16
    routings = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        routings.append((torch.randint(0, e + 1, (t, k), generator=g), torch.ones(t, k)))
    routings += [
        (torch.zeros(t, k, dtype=torch.int64), torch.ones(t, k)),
        (torch.full((t, k), e), torch.ones(t, k)),
        (torch.zeros(t, k, dtype=torch.int64), torch.zeros(t, k)),
    ]
    shapes = set()
    for ids, w in routings:
        al = align_routes(ids.int(), w, e, bm)
        shapes.add(tuple(tuple(v.shape) for v in vars(al).values() if torch.is_tensor(v)))
    assert len(shapes) == 1
    assert next(iter(shapes))[0] == (padded_length(t * k, e, bm),)


R = TypeVar("R")


# --- whole layer: FusedExperts inside a tiny LFM2-MoE / ZAYA1 block, Triton vs CPU torch ---


def _tiny_cfg(arch: str, model_type: str, **overrides: object) -> ModelConfig:
    return ModelConfig.from_hf_dict({**TINY_PRESETS[arch], "model_type": model_type, **overrides})


def _randomize_(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) * fan_in**-0.5)


def _spy_triton(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = moe_triton.fused_moe_triton

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_triton, "fused_moe_triton", spy)
    return calls


def _by_backend(
    monkeypatch: pytest.MonkeyPatch, block: nn.Module, run: Callable[[], R], backend: str
) -> R:
    """`run()` with `block`'s kernels bound under SHORTCONV_KERNELS=backend (as if built so)."""
    monkeypatch.setenv("SHORTCONV_KERNELS", backend)
    rebind_kernels(block, torch.device("cpu"), monkeypatch)
    with torch.inference_mode():
        return run()


@pytest.mark.parametrize("t", [1, 23])
def test_lfm2_moe_block_triton_matches_torch(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _tiny_cfg("lfm2_moe", "lfm2_moe")
    block = SigmoidTopKMoE(cfg, ParallelContext()).eval()
    _randomize_(block, seed=5)
    x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(t))
    calls = _spy_triton(monkeypatch)
    ref = _by_backend(monkeypatch, block, lambda: block(x), "torch")
    assert not calls
    got = _by_backend(monkeypatch, block, lambda: block(x), "triton")
    assert calls  # the layer really dispatched to the Triton kernel
    assert ref.abs().sum() > 0
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh"])
def test_zaya1_moe_block_triton_matches_torch(
    hidden_act: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 1 (router state from a previous layer) with the skip bias raised so that about
    half the tokens take the skip route: they must come out as zeros on both paths."""
    cfg = _tiny_cfg("zaya1", "zaya", hidden_act=hidden_act)
    block = ZayaMoE(cfg, layer_id=1, tp=ParallelContext()).eval()
    _randomize_(block, seed=9)
    t = 24
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, cfg.hidden_size, generator=g)
    prev = torch.randn(t, cfg.router_hidden_size, generator=g)
    biases = block.gate.balancing_biases
    with torch.inference_mode():
        biases.zero_()
        _, _, state = block.gate(x, prev)
        probs = torch.softmax(block.gate.router_mlp(state), dim=-1)
        # The median margin by which the best expert beats the skip class: ~half skip.
        biases[-1] = (probs[:, :-1].max(-1).values - probs[:, -1]).median()
        _, ids, _ = block.gate(x, prev)
    skipped = ids[:, 0] == cfg.num_experts
    assert 0 < int(skipped.sum()) < t
    calls = _spy_triton(monkeypatch)
    ref, ref_state = _by_backend(monkeypatch, block, lambda: block(x, prev), "torch")
    got, got_state = _by_backend(monkeypatch, block, lambda: block(x, prev), "triton")
    assert calls
    torch.testing.assert_close(got_state, ref_state)
    assert torch.equal(got[skipped], torch.zeros_like(got[skipped]))
    assert ref[~skipped].abs().sum() > 0
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
