"""Under tensor parallelism each rank reads only its shard of an adapter from the file.

The engine reads the adapter's config and the weights file's header (what it ships to the
ranks holds no weights); a rank then reads, with safetensors' get_slice, B's rows of a
column-parallel base's shard (per packed part), A's columns of a row-parallel one, B's rows
of a row-sliced one, and both whole beside a replicated one. What it materializes from the
file has the shard's shape, and the slot holds exactly those slices of the full tensors.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from shortconv.execution.parallel import ParallelContext
from shortconv.layers.linear import (
    ColumnParallelLinear,
    ColumnSliceLinear,
    LinearBase,
    ReplicatedLinear,
    RowParallelLinear,
)
from shortconv.layers.linear_float import FLOAT
from shortconv.lora import shard_read
from shortconv.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoraError, read_adapter
from shortconv.lora.batch import LoraBatch
from shortconv.lora.install import install_adapter
from shortconv.lora.linear import LoRALinear

IN, OUT, RANK, ALPHA = 12, 18, 4, 8
TP = ParallelContext(1, 2, None)  # rank 1 of 2: its shard is never the file's first rows
# module -> (the full A's column slice, the full B's row slice) rank 1 holds
SHARDS: dict[str, tuple[list[slice], list[slice]]] = {
    "col": ([slice(0, IN)], [slice(3, 6), slice(9, 12), slice(15, 18)]),  # 3 packed parts
    "row": ([slice(6, 12)], [slice(0, OUT)]),
    "rows": ([slice(0, IN)], [slice(2, 5), slice(10, 14)]),
    "rep": ([slice(0, IN)], [slice(0, OUT)]),
}


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.col = ColumnParallelLinear(IN, OUT, False, TP, parts=3)
        self.row = RowParallelLinear(IN, OUT, False, TP)
        self.rows = ColumnSliceLinear(IN, ((2, 5), (10, 14)), False)
        self.rep = ReplicatedLinear(IN, OUT, False)


def _model() -> _Model:
    model = _Model().requires_grad_(False)
    batch = LoraBatch(max_loras=2, max_rank=RANK, device=torch.device("cpu"))
    for m in model.modules():
        if isinstance(m, LinearBase):
            m.weight.normal_()
            m.method = LoRALinear(FLOAT, batch)
            m.method.process_after_load(m)
    return model


def _write_adapter(root: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    full = {
        m: (torch.randn(RANK, IN, generator=gen), torch.randn(OUT, RANK, generator=gen))
        for m in SHARDS
    }
    root.mkdir()
    cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(SHARDS)}
    (root / CONFIG_FILE).write_text(json.dumps(cfg))
    tensors = {}
    for m, (a, b) in full.items():
        tensors[f"base_model.model.{m}.lora_A.weight"] = a
        tensors[f"base_model.model.{m}.lora_B.weight"] = b
    save_file(tensors, str(root / WEIGHTS_FILE))
    return full


class _Recorder:
    """safe_open as shard_read uses it, recording the shape of every tensor it reads."""

    def __init__(self, real: Any, shapes: list[tuple[int, ...]]) -> None:
        self.real, self.shapes = real, shapes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outer = self

        class _File:
            def __init__(self, f: Any) -> None:
                self.f = f

            def get_slice(self, key: str) -> Any:
                sl = self.f.get_slice(key)

                class _Slice:
                    def __getitem__(self, index: Any) -> torch.Tensor:
                        t = sl[index]
                        outer.shapes.append(tuple(t.shape))
                        return t

                return _Slice()

            def get_tensor(self, key: str) -> torch.Tensor:
                t = self.f.get_tensor(key)
                outer.shapes.append(tuple(t.shape))
                return t

        class _Ctx:
            def __enter__(self) -> _File:
                self.cm = outer.real(*args, **kwargs)
                return _File(self.cm.__enter__())

            def __exit__(self, *exc: Any) -> None:
                self.cm.__exit__(*exc)

        return _Ctx()


def test_the_adapter_shipped_to_the_ranks_holds_no_weights(tmp_path: Path) -> None:
    full = _write_adapter(tmp_path / "a")
    adapter = read_adapter(tmp_path / "a")
    tensor_bytes = sum(a.nbytes + b.nbytes for a, b in full.values())
    assert adapter.nbytes == tensor_bytes
    shipped = pickle.dumps(adapter)  # what RayExecutor.load_lora puts in the object store
    assert b"_rebuild_tensor" not in shipped and len(shipped) < tensor_bytes


def test_a_rank_reads_only_its_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _write_adapter(tmp_path / "a")
    shapes: list[tuple[int, ...]] = []
    monkeypatch.setattr(shard_read, "safe_open", _Recorder(shard_read.safe_open, shapes))
    model = _model()
    install_adapter(model, {}, 1, read_adapter(tmp_path / "a"), TP)
    want_shapes = []
    for m, (cols, rows) in SHARDS.items():
        a, b = full[m]
        want_a = torch.cat([a[:, c] for c in cols], dim=1)
        want_b = torch.cat([b[r] for r in rows], dim=0)
        want_shapes += [tuple(a[:, c].shape) for c in cols] + [tuple(b[r].shape) for r in rows]
        slots = getattr(model, m).lora
        torch.testing.assert_close(slots.a[1], want_a, rtol=0, atol=0)
        torch.testing.assert_close(slots.b[1], want_b * (ALPHA / RANK))
        assert slots.ranks[1] == RANK and not slots.a[0].any()
    # every read is one shard slice: B is read whole only beside the row-parallel and
    # replicated bases, A whole only beside the column-parallel and row-sliced ones
    assert sorted(shapes) == sorted(want_shapes)
    assert shapes.count((OUT, RANK)) == 2 and shapes.count((RANK, IN)) == 3


def test_a_file_changed_since_it_was_read_is_refused(tmp_path: Path) -> None:
    _write_adapter(tmp_path / "a")
    adapter = read_adapter(tmp_path / "a")
    model = _model()
    file = tmp_path / "a" / WEIGHTS_FILE
    st = file.stat()
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(LoraError, match="changed on disk since the adapter was loaded"):
        install_adapter(model, {}, 0, adapter, TP)
    assert not model.col.lora.a.any()  # nothing written
