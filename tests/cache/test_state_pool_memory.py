"""The CPU state pool costs resident memory only for the pages it touches, and still reads as
zeros everywhere (what `torch.zeros` gave every kernel before)."""

from __future__ import annotations

import os

import pytest
import torch

from shortconv.cache.state_pool import KVSpec, StatePool, StateSpec, lazy_zeros

CPU = torch.device("cpu")
MIB = 2**20


def _resident(tensors: list[torch.Tensor]) -> int:
    """Resident bytes of the memory mappings that hold `tensors` (/proc/self/smaps). NOTE:
    not the process's RSS: a pytest worker's other threads allocate meanwhile."""
    spans = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors]
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = any(a < hi and lo < b for a, b in spans)
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def _pool(dtype: torch.dtype, pages: int) -> StatePool:
    kv = KVSpec(layer_ids=(1, 3), num_kv_heads=4, head_dim=64, page_size=16, num_pages=pages)
    return StatePool([StateSpec("conv", (0, 2), (32, 3))], kv, 4, dtype, CPU)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_an_untouched_kv_pool_is_not_resident() -> None:
    pages = 8192  # K and V: 2 * 2 layers * 8192*16 rows * 4 heads * 64 * 4 B = 256 MiB
    pool = _pool(torch.float32, pages)
    assert pool.nbytes() > 256 * MIB
    tensors = [t for caches in pool.kv_caches if caches for t in caches]
    before = _resident(tensors)
    assert before < 16 * MIB, "allocating the pool must not touch its pages"
    k, v = pool.kv(1)
    k[: 64 * 16].fill_(1.0)  # 64 pages of one layer's K: 1 MiB
    grown = _resident(tensors) - before
    assert MIB <= grown < 17 * MIB, "only the written pages become resident"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_tensors_are_aligned_contiguous_zeros(dtype: torch.dtype) -> None:
    pool = _pool(dtype, 64)
    tensors = [*pool.states.values(), *pool.kv_caches[0]]
    for t in tensors:
        assert t.dtype == dtype and t.is_contiguous() and t.device == CPU
        assert t.data_ptr() % 64 == 0
        assert not t.any()
    assert pool.kv(3)[0].shape == (64 * 16, 4, 64)
    assert pool.state("conv", 2).shape == (4, 32, 3)


def test_lazy_zeros_of_no_elements_and_off_cpu() -> None:
    assert lazy_zeros((0, 5), torch.float32, CPU).shape == (0, 5)
    meta = lazy_zeros((3, 2), torch.bfloat16, torch.device("meta"))
    assert meta.device.type == "meta" and meta.shape == (3, 2)
