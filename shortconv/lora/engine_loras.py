"""The engine's side of LoRA: load and unload by name, and bind a request to its adapter."""

from __future__ import annotations

import logging
from collections.abc import Callable, Set
from pathlib import Path

from shortconv.engine.executor import BaseExecutor
from shortconv.engine.request import Request
from shortconv.lora.adapter import LoraError, read_adapter
from shortconv.lora.counters import LoraCounters
from shortconv.lora.slots import LoraSlotManager

log = logging.getLogger(__name__)


class EngineLoras:
    """Adapters by name over the executor's slots. `busy_slots` gives the slots live requests
    point at, which are never reused under them."""

    def __init__(
        self,
        executor: BaseExecutor,
        max_loras: int,
        max_rank: int,
        busy_slots: Callable[[], Set[int]],
    ) -> None:
        self.executor, self.max_rank, self.busy_slots = executor, max_rank, busy_slots
        self.slots = LoraSlotManager(max_loras)
        self.counters = LoraCounters()

    def load(self, name: str, path: str | Path) -> None:
        """Read, check and place an adapter under `name`; LoraError (nothing kept, counted by
        its reason) otherwise."""
        try:
            self._load(name, path)
        except LoraError as exc:
            self.counters.refused[exc.reason] += 1
            raise
        self.counters.loads += 1
        self.counters.named(name)

    def _load(self, name: str, path: str | Path) -> None:
        if name in self.slots.names:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded", "duplicate")
        adapter = read_adapter(path)
        if adapter.rank > self.max_rank:
            msg = f"{path}: rank {adapter.rank} is above max_lora_rank {self.max_rank}"
            raise LoraError(msg, "rank")
        self.slots.register(name, adapter)
        try:
            self._resident_slot(name)
        except Exception:
            self.slots.unregister(name)
            raise
        log.info("LoRA adapter %r loaded from %s (rank %d)", name, path, adapter.rank)

    def unload(self, name: str) -> None:
        self.slots.get(name)  # LoraError for an unknown name
        slot = self.slots.slot_of(name)
        if slot is not None and slot in self.busy_slots():
            raise LoraError(f"LoRA adapter {name!r} serves live requests; unload it after them")
        self.slots.unregister(name)
        if slot is not None:
            self.executor.unload_lora(slot)
        self.counters.unloads += 1

    def bind(self, req: Request, name: str) -> None:
        """Point `req` at `name`'s slot (written back first if it was evicted)."""
        req.lora_key, req.lora_name = self.slots.get(name).key, name
        req.lora_slot = self._resident_slot(name)
        self.counters.request(name)

    def _resident_slot(self, name: str) -> int:
        slot, write, evicted = self.slots.place(name, self.busy_slots())
        self.counters.evictions += evicted
        if write:
            try:
                self.executor.load_lora(slot, self.slots.get(name).adapter)
            except Exception:
                self.slots.evict(name)
                raise
        return slot
