"""The LRU slot manager: free slots first, then the least recently used one no live request
points at; refused when every slot serves live requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from shortconv.lora.adapter import LoraAdapter, LoraError
from shortconv.lora.slots import LoraSlotManager


def _adapter() -> LoraAdapter:
    return LoraAdapter(Path("x"), 4, 2.0, ("q_proj",), {}, (0, 0))


def test_lru_eviction_skips_busy_slots() -> None:
    m = LoraSlotManager(max_loras=2)
    for name in "abc":
        m.register(name, _adapter())
    assert m.place("a", set()) == (0, True, False)
    assert m.place("b", set()) == (1, True, False)
    assert m.place("a", set()) == (0, False, False)  # touched: b is now the least recent
    assert m.place("c", set()) == (1, True, True)  # evicts b
    assert m.slot_of("b") is None
    assert m.place("b", busy={1}) == (0, True, True)  # c (slot 1) is busy: a goes instead
    with pytest.raises(LoraError, match="all 2 LoRA slots"):
        m.place("a", busy={0, 1})
    assert m.resident == {"c": 1, "b": 0}


def test_keys_are_unique_per_load() -> None:
    m = LoraSlotManager(max_loras=1)
    first = m.register("a", _adapter()).key
    m.unregister("a")
    assert m.register("a", _adapter()).key != first
    with pytest.raises(LoraError, match="already loaded"):
        m.register("a", _adapter())
