"""Triton fused MoE with expert LoRA against its torch oracle (moe_lora_ref), on the engine's
own slot layout (ExpertLoraSlots' flat views), under the interpreter.

Rows mix adapter slots, -1 (no adapter) and the graph buffer's zero slot (num_loras); routes
include ZAYA1's skip id (E) and a zero weight; slots hold adapters of different ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from shortconv.kernels.moe_lora_ref import ExpertLoraRows, fused_moe_lora_ref  # noqa: E402
from shortconv.kernels.moe_lora_triton import fused_moe_lora_triton  # noqa: E402
from shortconv.kernels.moe_ref import fused_moe_ref  # noqa: E402
from shortconv.kernels.moe_triton import fused_moe_triton  # noqa: E402
from shortconv.lora.batch import LoraBatch  # noqa: E402
from shortconv.lora.experts import ExpertLoraSlots  # noqa: E402

E, H, INTER, N = 4, 48, 40, 3
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _slots(weight: torch.Tensor, ranks: list[int], g: torch.Generator) -> ExpertLoraSlots:
    """Flat-layout slots for `weight` [E, out, in], slot s filled to rank ranks[s] the way a
    load writes PEFT's stacked pair (ExpertLoraSlots.write)."""
    slots = ExpertLoraSlots.empty(weight, LoraBatch(N, max(ranks), weight.device), flat=True)
    _, out_f, in_f = weight.shape
    for s, r in enumerate(ranks):
        a = torch.randn(r * E, in_f, generator=g) / in_f**0.5
        b = torch.randn(out_f, r * E, generator=g) / r**0.5
        slots.write(s, a.to(weight.dtype), b.to(weight.dtype), 1.0)
    return slots


def _case(dtype: torch.dtype, t: int, k: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, INTER, generator=g) / INTER**0.5).to(dtype)
    ids = torch.randint(0, E + 1, (t, k), generator=g)  # E: the skip route
    weights = torch.rand(t, k, generator=g)
    weights[1, 0] = 0.0
    rows = torch.randint(-1, N + 1, (t,), generator=g)  # -1 and N (zero slot): no adapter
    gu, dn = _slots(gate_up, [4, 8, 2], g), _slots(down, [8, 3, 4], g)
    assert gu.flat is not None and dn.flat is not None
    lora = ExpertLoraRows(*gu.flat, *dn.flat, rows, 8, N)
    return x, gate_up, down, ids, weights, lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "k"), [(7, 2), (5, 1)])
def test_kernel_equals_ref(dtype: torch.dtype, t: int, k: int) -> None:
    x, gate_up, down, ids, weights, lora = _case(dtype, t, k, seed=t * 10 + k)
    got = fused_moe_lora_triton(x, gate_up, down, ids, weights, "silu", lora)
    want = fused_moe_lora_ref(x, gate_up, down, ids, weights, "silu", lora)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    # The adapters change the rows that have one (else this test could not fail).
    live = (lora.token_slots >= 0) & (lora.token_slots < N)
    base = fused_moe_ref(x, gate_up, down, ids, weights, "silu")
    assert (got - base)[live].abs().amax() > 0.05


def test_rows_without_an_adapter_equal_the_base_kernel_bit_for_bit() -> None:
    x, gate_up, down, ids, weights, lora = _case(torch.float32, 9, 2, seed=3)
    got = fused_moe_lora_triton(x, gate_up, down, ids, weights, "silu", lora)
    base = fused_moe_triton(x, gate_up, down, ids, weights, "silu")
    none = (lora.token_slots < 0) | (lora.token_slots >= N)
    assert none.any() and torch.equal(got[none], base[none])


def test_the_ref_is_the_base_ref_plus_each_experts_own_adapter() -> None:
    """The oracle against the math written out, one route at a time, expert e's slot s read
    from the store as loads wrote it ([E, rank, slot, in] / [E, out, rank, slot])."""
    x, gate_up, down, ids, weights, lora = _case(torch.float32, 4, 2, seed=5)
    got = fused_moe_lora_ref(x, gate_up, down, ids, weights, "silu", lora)
    want = torch.zeros_like(x)
    a_gu = lora.a_gate_up.view(E, N, -1, H)
    b_gu = lora.b_gate_up.view(E, N, 2 * INTER, -1)
    a_d, b_d = lora.a_down.view(E, N, -1, INTER), lora.b_down.view(E, N, H, -1)
    for t in range(x.shape[0]):
        s = int(lora.token_slots[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= E:
                continue
            gu = gate_up[e] @ x[t]
            if 0 <= s < N:
                gu = gu + b_gu[e, s] @ (a_gu[e, s] @ x[t])
            h = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
            y = down[e] @ h
            if 0 <= s < N:
                y = y + b_d[e, s] @ (a_d[e, s] @ h)
            want[t] += weights[t, j] * y
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused() -> None:
    x, gate_up, down, ids, weights, lora = _case(torch.float32, 4, 2, seed=1)
    short = dataclasses.replace(lora, a_gate_up=lora.a_gate_up[:-1])
    with pytest.raises(ValueError, match="a_gate_up must be"):
        fused_moe_lora_triton(x, gate_up, down, ids, weights, "silu", short)
    rows = dataclasses.replace(lora, token_slots=lora.token_slots[:2])
    with pytest.raises(ValueError, match="token_slots must be"):
        fused_moe_lora_triton(x, gate_up, down, ids, weights, "silu", rows)
