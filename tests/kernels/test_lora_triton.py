"""Triton batched LoRA (shrink / expand) against its torch oracle, and against the CPU stacked
and grouped paths the engine runs on CPU, on the engine's own slot layout (LoraSlots).

Runs under Triton's interpreter on CPU (TRITON_INTERPRET set per test; lora_triton jits lazily
once per mode). Slots hold adapters of different ranks (zero past each rank, as loads write
them); rows mix slots, -1 (no adapter) and the graph buffer's zero slot (num_slots).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shortconv.kernels.lora_ref import lora_expand_ref, lora_shrink_ref  # noqa: E402
from shortconv.kernels.lora_triton import (  # noqa: E402
    align_rows,
    lora_delta_triton,
    lora_expand_triton,
    lora_shrink_triton,
)
from shortconv.lora.batch import LoraBatch  # noqa: E402
from shortconv.lora.delta import add_grouped, add_stacked  # noqa: E402
from shortconv.lora.linear import LoraSlots  # noqa: E402
from shortconv.lora.step import NO_ADAPTER, LoraGroup, resolve_step  # noqa: E402

# (atol, rtol): the kernel and the oracle both accumulate in fp32 and round the shrink to the
# dtype; they differ by summation order, i.e. an ulp of the dtype after either rounding.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
NUM_SLOTS = 4


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _slots(in_f: int, out_f: int, ranks: list[int], dtype: torch.dtype, seed: int) -> LoraSlots:
    """The engine's slot storage for one layer, each slot s filled to rank ranks[s]."""
    g = torch.Generator().manual_seed(seed)
    batch = LoraBatch(NUM_SLOTS, max(ranks), torch.device("cpu"))
    slots = LoraSlots.empty(torch.empty(out_f, in_f, dtype=dtype), batch)
    for s, r in enumerate(ranks):
        slots.a[s, :r] = (torch.randn(r, in_f, generator=g) / in_f**0.5).to(dtype)
        slots.b[s, :, :r] = (torch.randn(out_f, r, generator=g) / r**0.5).to(dtype)
    return slots


def _rows(num_rows: int, seed: int) -> torch.Tensor:
    """Mixed slots in a shuffled order, some rows -1 and some the zero slot (NUM_SLOTS)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, NUM_SLOTS + 1, (num_rows,), generator=g)


def _x(num_rows: int, in_f: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, in_f, generator=torch.Generator().manual_seed(seed)).to(dtype)


# (rows, in, out, slot ranks): odd sizes off the 64-wide tiles; ranks 8, 16 and 64.
CASES = {
    "decode_r8": (5, 40, 24, [8, 4, 8, 2]),
    "decode_r16": (19, 72, 50, [16, 8, 16, 1]),
    "prefill_r64": (70, 33, 130, [64, 16, 8, 64]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_shrink_and_expand_match_ref(name: str, dtype: torch.dtype) -> None:
    t, in_f, out_f, ranks = CASES[name]
    slots, ids = _slots(in_f, out_f, ranks, dtype, seed=1), _rows(t, seed=2)
    x, rank = _x(t, in_f, dtype, seed=3), max(ranks)
    atol, rtol = TOL[dtype]
    align = align_rows(ids, NUM_SLOTS)
    s = lora_shrink_triton(x, slots.a, ids, rank, align=align)
    ref_s = lora_shrink_ref(x, slots.a, ids, rank)
    assert s.dtype == dtype and s.shape == (t, rank) and ref_s.abs().sum() > 0
    torch.testing.assert_close(s, ref_s, atol=atol, rtol=rtol)
    y0 = _x(t, out_f, dtype, seed=4)
    got = lora_expand_triton(y0.clone(), ref_s, slots.b, ids, scale=0.5, align=align)
    want = lora_expand_ref(y0.clone(), ref_s, slots.b, ids, scale=0.5)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    dead = (ids < 0) | (ids >= NUM_SLOTS)
    assert dead.any() and (~dead).any()
    assert torch.equal(got[dead], y0[dead])  # rows without an adapter: untouched, bit for bit
    assert not torch.allclose(got[~dead].float(), y0[~dead].float(), atol=atol)


@pytest.mark.parametrize("rank", [8, 16, 64])
def test_delta_matches_cpu_stacked_and_grouped_paths(rank: int) -> None:
    """The whole adapter product on the engine's step: the CPU paths (lora.delta, from the
    step lora.step resolves for these rows) against the Triton kernels, fp32."""
    t, in_f, out_f = 23, 72, 50
    ranks = [rank, rank // 2, rank, 1]
    slots = _slots(in_f, out_f, ranks, torch.float32, seed=5)
    ids = _rows(t, seed=6).clamp(max=NUM_SLOTS - 1)  # the CPU paths take -1 for no adapter
    x, y0 = _x(t, in_f, torch.float32, seed=7), _x(t, out_f, torch.float32, seed=8)
    step = resolve_step(ids.tolist(), ranks, torch.device("cpu"))
    assert step is not None and step.mask is not None and step.rank == rank
    stacked = y0.clone()
    add_stacked(stacked, x, *slots.stacked(step.rank), step.mask)
    grouped = y0.clone()
    used = sorted(set(ids.tolist()) - {NO_ADAPTER})
    groups = tuple(LoraGroup(s, torch.nonzero(ids == s).flatten()) for s in used)
    add_grouped(grouped, x, slots.a, slots.b, ranks, groups)
    got = lora_delta_triton(
        y0.clone(), x, slots.a, slots.b, ids, rank, align=align_rows(ids, NUM_SLOTS)
    )
    torch.testing.assert_close(stacked, grouped, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, stacked, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, y0)


def test_rank_above_64_and_bad_shapes_are_refused() -> None:
    slots = _slots(16, 16, [8, 8, 8, 8], torch.float32, seed=0)
    x, ids = _x(3, 16, torch.float32, seed=0), torch.tensor([0, -1, 2])
    align = align_rows(ids, NUM_SLOTS)
    with pytest.raises(ValueError, match="rank"):
        lora_shrink_triton(x, slots.a, ids, 9, align=align)
    with pytest.raises(ValueError, match="slots"):
        lora_shrink_triton(x, slots.a, ids[:2], 8, align=align)
    with pytest.raises(ValueError, match="does not fit"):
        lora_shrink_triton(x.half(), slots.a, ids, 8, align=align)
    big = _slots(16, 16, [65, 1, 1, 1], torch.float32, seed=0)
    with pytest.raises(ValueError, match="1..64"):
        lora_shrink_triton(x, big.a, ids, 65, align=align)
    # an alignment made for other rows (a longer step's) is refused, not read past its end
    other = align_rows(torch.zeros(40, dtype=torch.int64), NUM_SLOTS)
    with pytest.raises(ValueError, match="align was made for other rows"):
        lora_shrink_triton(x, slots.a, ids, 8, align=other)
    s = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="align was made for other rows"):
        lora_expand_triton(torch.zeros(3, 16), s, slots.b, ids, align=other)
