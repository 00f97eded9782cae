"""What a LoRA step builds, once, for the path bound at build (lora.batch, lora.kernel).

On the Triton path the rows' alignment by slot (`align_rows`) is the same for every adapted
projection of a step: it is made once per step (once per row count inside a captured region),
not once per layer, and every layer's delta reads it; the torch path's mask and groups are
never built there. On the torch path nothing of the kernel's is made. Each layer's output
still equals a row-by-row reference."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from shortconv.execution.parallel import SINGLE
from shortconv.layers.linear import ColumnParallelLinear
from shortconv.layers.linear_float import FLOAT
from shortconv.lora import batch as lora_batch
from shortconv.lora.batch import LoraBatch
from shortconv.lora.linear import LoRALinear

CPU = torch.device("cpu")
ROWS = [0, -1, 1, 0, 1, -1, 0]
NUM_LAYERS = 3


def _layers(batch: LoraBatch) -> list[tuple[ColumnParallelLinear, list]]:
    """NUM_LAYERS layers sharing `batch`, slots 0 and 1 filled (ranks 4 and 2)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(NUM_LAYERS):
        layer = ColumnParallelLinear(16, 24, False, SINGLE).requires_grad_(False)
        layer.weight.copy_(torch.randn(24, 16, generator=gen))
        layer.method = LoRALinear(FLOAT, batch)
        layer.method.process_after_load(layer)
        assert layer.lora is not None
        pairs = [
            (torch.randn(r, 16, generator=gen), torch.randn(24, r, generator=gen)) for r in (4, 2)
        ]
        for slot, (a, b) in enumerate(pairs):
            r = a.shape[0]
            layer.lora.a[slot, :r], layer.lora.b[slot, :, :r] = a, b
            layer.lora.ranks[slot] = r
            batch.set_slot_rank(slot, r)
        out.append((layer, pairs))
    return out


def _check(layer: ColumnParallelLinear, pairs: list, x: torch.Tensor, rows: list[int]) -> None:
    want = x @ layer.weight.t()
    for t, slot in enumerate(rows):
        if 0 <= slot < len(pairs):
            a, b = pairs[slot]
            want[t] += (x[t] @ a.t()) @ b.t()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)


@pytest.fixture()
def triton_path(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """SHORTCONV_KERNELS=triton under the interpreter, `align_rows` and the delta counted (set
    before any batch is built: the batch binds them at build)."""
    pytest.importorskip("triton")
    from shortconv.kernels import lora_triton

    monkeypatch.setenv("SHORTCONV_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls: Counter[str] = Counter()
    for name in ("align_rows", "lora_delta_triton"):
        real = getattr(lora_triton, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(lora_triton, name, counted)
    return calls


def test_triton_path_aligns_once_per_step_not_per_layer(triton_path: Counter[str]) -> None:
    batch = LoraBatch(max_loras=2, max_rank=4, device=CPU)
    layers = _layers(batch)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        before = triton_path["align_rows"]
        batch.set_rows(ROWS, CPU)
        for layer, pairs in layers:
            _check(layer, pairs, torch.randn(len(ROWS), 16, generator=gen), ROWS)
        assert triton_path["align_rows"] - before == 1, f"step {step}"
    assert triton_path["lora_delta_triton"] == 2 * NUM_LAYERS


def test_graph_steps_align_once_per_row_count(triton_path: Counter[str]) -> None:
    """Inside a graphed region (as captured: from the static slots) the first layer at a row
    count aligns, the others at that count reuse it; re-entering the region aligns afresh."""
    batch = LoraBatch(max_loras=2, max_rank=4, device=CPU)
    layers = _layers(batch)
    batch.reserve(16, CPU)
    gen = torch.Generator().manual_seed(2)
    padded = {8: ROWS + [2], 4: ROWS[:4]}  # the zero slot (2) pads the bucket
    for region in range(2):
        batch.set_rows(ROWS if region == 0 else ROWS[:4], CPU)
        rows = padded[8] if region == 0 else padded[4] + [2] * 4
        before = triton_path["align_rows"]
        batch.graphed = True
        for n in (8, 4):
            for layer, pairs in layers:
                _check(layer, pairs, torch.randn(n, 16, generator=gen), rows[:n])
        batch.graphed = False
        assert triton_path["align_rows"] - before == 2, f"region {region}: one per row count"


def test_triton_path_builds_no_mask_or_groups(
    triton_path: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch path's step (mask or groups) is not resolved where the kernel runs."""

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("resolve_step on the Triton path")

    monkeypatch.setattr(lora_batch, "resolve_step", refuse)
    batch = LoraBatch(max_loras=2, max_rank=4, device=CPU)
    layers = _layers(batch)
    assert batch.kernel is not None
    batch.set_rows(ROWS, CPU)
    assert batch.step is None
    rows = batch.kernel_rows(len(ROWS))
    assert rows is not None and rows.rank == 4 and rows.slots.tolist() == ROWS
    _check(*layers[0], torch.randn(len(ROWS), 16), ROWS)
    batch.set_rows([-1] * 3, CPU)  # no adapter rows: nothing to align, every layer its base
    assert batch.kernel_rows(3) is None and triton_path["align_rows"] == 1


def test_torch_path_builds_no_kernel_rows() -> None:
    batch = LoraBatch(max_loras=2, max_rank=4, device=CPU)
    layers = _layers(batch)
    assert batch.kernel is None
    batch.set_rows(ROWS, CPU)
    assert batch.step is not None and batch.step.mask is not None
    assert batch.kernel_rows(len(ROWS)) is None
    _check(*layers[0], torch.randn(len(ROWS), 16), ROWS)
