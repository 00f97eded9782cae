"""The engine's adapters: names registered, and which of them sit in the `max_loras` slots.

An adapter keeps its name (and its checked file index: each rank reads its weights from the
file when the adapter is written into a slot) from `load_lora` to `unload_lora`; a request for
one that was evicted puts it back into a slot. Slots are reused
least recently used first, never while a live request (waiting or running) points at them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set
from dataclasses import dataclass

from shortconv.lora.adapter import LoraAdapter, LoraError


@dataclass(frozen=True)
class Registered:
    """A loaded name: its adapter and a key unique to this load, which prefix-cache and
    session keys carry, so state made under one adapter (or an earlier load of the same
    name) is never reused under another."""

    adapter: LoraAdapter
    key: int


class LoraSlotManager:
    """Names → adapters; slots → resident names, in LRU order."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.names: dict[str, Registered] = {}
        self._resident: OrderedDict[str, int] = OrderedDict()  # name → slot, LRU first
        self._next_key = 1

    def register(self, name: str, adapter: LoraAdapter) -> Registered:
        if name in self.names:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded", "duplicate")
        reg = Registered(adapter, self._next_key)
        self._next_key += 1
        self.names[name] = reg
        return reg

    def unregister(self, name: str) -> None:
        self.names.pop(name)
        self._resident.pop(name, None)

    def get(self, name: str) -> Registered:
        reg = self.names.get(name)
        if reg is None:
            loaded = sorted(self.names)
            raise LoraError(f"unknown LoRA adapter {name!r} (loaded: {loaded})", "unknown")
        return reg

    @property
    def resident(self) -> dict[str, int]:
        """Resident names → slots, least recently used first."""
        return dict(self._resident)

    def slot_of(self, name: str) -> int | None:
        return self._resident.get(name)

    def place(self, name: str, busy: Set[int]) -> tuple[int, bool, bool]:
        """(`name`'s slot, whether its weights must be written there, whether another adapter
        was evicted for it): a resident name is touched; otherwise a free slot, else the least
        recently used one not in `busy`."""
        if name in self._resident:
            self._resident.move_to_end(name)
            return self._resident[name], False, False
        used = set(self._resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        evicted = not free
        if evicted:
            victim = next((n for n, s in self._resident.items() if s not in busy), None)
            if victim is None:
                raise LoraError(
                    f"all {self.max_loras} LoRA slots (max_loras) serve live requests; "
                    f"retry {name!r} later",
                    "no_slot",
                )
            free = [self._resident.pop(victim)]
        self._resident[name] = free[0]
        return free[0], True, evicted

    def evict(self, name: str) -> None:
        """Forget `name`'s slot (its write failed, or the slot must be reused)."""
        self._resident.pop(name, None)
