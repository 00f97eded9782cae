"""The LoRA layer's two ways of adding a step's adapters (lora.step: stacked, grouped) and the
graph step's stacked path each equal a row-by-row reference: y[t] = x[t] W^T + (x[t] A_s^T)
B_s^T with each row's own slot s, exactly the base for rows with none."""

from __future__ import annotations

import pytest
import torch

from shortconv.execution.parallel import SINGLE
from shortconv.layers.linear import ColumnParallelLinear
from shortconv.layers.linear_float import FLOAT
from shortconv.lora import step as lora_step
from shortconv.lora.batch import LoraBatch
from shortconv.lora.linear import LoRALinear

RANKS = (8, 3, 5)  # slot 1 and 2 zero-padded below max_rank
ROWS = [0, -1, 2, 1, 0, 2, -1, 1]


def _layer() -> tuple[ColumnParallelLinear, LoraBatch, list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    layer = ColumnParallelLinear(32, 48, False, SINGLE).requires_grad_(False)
    layer.weight.copy_(torch.randn(48, 32, generator=gen))
    batch = LoraBatch(max_loras=len(RANKS), max_rank=8, device=torch.device("cpu"))
    layer.method = LoRALinear(FLOAT, batch)
    layer.method.process_after_load(layer)
    assert layer.lora is not None
    adapters = [
        (torch.randn(r, 32, generator=gen), torch.randn(48, r, generator=gen)) for r in RANKS
    ]
    for slot, (a, b) in enumerate(adapters):
        layer.lora.a[slot, : a.shape[0]] = a
        layer.lora.b[slot, :, : a.shape[0]] = b
        layer.lora.ranks[slot] = a.shape[0]
        batch.set_slot_rank(slot, a.shape[0])
    return layer, batch, adapters


def _want(layer: ColumnParallelLinear, x: torch.Tensor, adapters: list) -> torch.Tensor:
    want = x @ layer.weight.t()
    for row, slot in enumerate(ROWS):
        if slot >= 0:
            a, b = adapters[slot]
            want[row] += (x[row] @ a.t()) @ b.t()
    return want


@pytest.mark.parametrize("stacked", [True, False])
def test_eager_step_equals_rows_one_by_one(stacked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not stacked:
        monkeypatch.setattr(lora_step, "STACKED_MAX_ROWS", 0)
    layer, batch, adapters = _layer()
    x = torch.randn(len(ROWS), 32, generator=torch.Generator().manual_seed(1))
    batch.set_rows(ROWS, x.device)
    assert batch.step is not None and (batch.step.mask is not None) == stacked
    got = layer(x)
    torch.testing.assert_close(got, _want(layer, x, adapters), rtol=1e-5, atol=1e-4)
    base = FLOAT.apply(layer, x, None)
    for row in (1, 6):
        assert torch.equal(got[row], base[row])


def _check_step(graphed: bool, seed: int) -> None:
    """A layer built now (so under the test's SHORTCONV_KERNELS) on ROWS equals `_want`,
    eager or from the static slots (`graphed`); rows with no adapter equal the base."""
    layer, batch, adapters = _layer()
    assert layer.lora is not None
    batch.reserve(16, torch.device("cpu"))
    x = torch.randn(len(ROWS), 32, generator=torch.Generator().manual_seed(seed))
    batch.set_rows(ROWS, x.device)
    batch.graphed = graphed
    got = layer(x)
    torch.testing.assert_close(got, _want(layer, x, adapters), rtol=1e-5, atol=1e-4)
    base = FLOAT.apply(layer, x, None)
    for row in (1, 6):
        assert torch.equal(got[row], base[row])


def test_graph_step_reads_the_static_slots() -> None:
    _check_step(graphed=True, seed=2)


def test_a_step_with_no_adapter_rows_is_the_base() -> None:
    layer, batch, _ = _layer()
    x = torch.randn(4, 32)
    batch.set_rows([-1] * 4, x.device)
    assert batch.step is None
    assert torch.equal(layer(x), x @ layer.weight.t())


def test_slots_stack_rank_major_as_views() -> None:
    layer, _, adapters = _layer()
    assert layer.lora is not None
    a, b = layer.lora.stacked(8)
    assert a.data_ptr() == layer.lora.a_store.data_ptr()
    assert b.data_ptr() == layer.lora.b_store.data_ptr()
    n = len(RANKS)
    for slot, (sa, sb) in enumerate(adapters):
        r = sa.shape[0]
        assert torch.equal(a[slot : r * n : n], sa)
        assert torch.equal(b[:, slot : r * n : n], sb)


@pytest.mark.parametrize("graphed", [False, True])
def test_triton_path_binds_the_kernel_and_equals_rows_one_by_one(
    graphed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHORTCONV_KERNELS=triton at build binds the Triton delta into the layer's slots; the
    forward then runs it (the torch paths raise) for eager and graph steps alike."""
    pytest.importorskip("triton")
    from shortconv.kernels import lora_triton
    from shortconv.lora import linear as lora_linear

    monkeypatch.setenv("SHORTCONV_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in ("add_stacked", "add_grouped"):
        monkeypatch.setattr(lora_linear, name, None)  # calling it would raise TypeError
    calls: list[int] = []
    real = lora_triton.lora_delta_triton

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_triton, "lora_delta_triton", spy)
    _check_step(graphed, seed=3)
    assert calls  # the layer bound the kernel at build and ran it
