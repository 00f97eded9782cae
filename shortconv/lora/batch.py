"""The step's LoRA rows: which adapter slot each token row uses, set once per step."""

from __future__ import annotations

import torch

from shortconv.engine.plan import StepPlan
from shortconv.lora.kernel import KernelRows, LoraKernel, lora_kernel
from shortconv.lora.step import NO_ADAPTER, LoraStep, resolve_step, stack_columns, step_rank

__all__ = ["NO_ADAPTER", "LoraBatch"]


class LoraBatch:
    """One per model (shared by every LoRA layer, made before the layers are bound): the
    runner sets it from the plan once per step, before the forward; layers only read it.

    The path is bound here, once, from the model's device: `kernel` (the Triton kernels,
    lora.kernel) or None (the torch paths of lora.step / lora.delta). A step builds only what
    its path reads:

    * torch: `step` (stacked mask or groups, chosen per step); None when no row has an
      adapter, and every LoRA layer is then its base method alone.
    * Triton: `kernel_rows(num_rows)`: each row's slot, the rank and the rows' alignment by
      slot, made once per step (`align_rows` is the same for every layer) and read by every
      layer's delta.

    Graph steps (`graphed`, on only inside the graph runner's captured region) read
    `token_slots` instead: a static buffer (`reserve`), each token row's slot, in place every
    step, with rows that have no adapter (and a bucket's pad rows) at `zero_slot`. Its shape
    never changes, so a captured graph reads it at the full max rank (fixed shapes, no host
    sync). On the Triton path the region's first LoRA layer aligns its rows and the rest read
    that alignment: a captured graph records `align_rows` once, and each replay recomputes it
    from `token_slots` into the graph's own (static) buffers before any layer reads them.

    NOTE: `zero_slot` is `max_loras`, a slot no layer holds: no stacked column matches it.
    `slot_ranks` is each slot's adapter rank (the runner sets it on load and unload); a slot
    it was never told of counts at `max_rank`, which is only ever too wide, never wrong
    (A and B are zero past a slot's rank)."""

    def __init__(self, max_loras: int, max_rank: int, device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.zero_slot = max_loras
        self.slot_ranks = [max_rank] * max_loras
        self.kernel: LoraKernel | None = lora_kernel(device)
        self.step: LoraStep | None = None
        self.token_slots: torch.Tensor | None = None
        self._graph_columns: torch.Tensor | None = None
        self._rows: KernelRows | None = None
        # The graphed region's alignment, by row count: made by its first layer, cleared
        # whenever the region is entered or left (never read across steps or captures).
        self._graph_rows: dict[int, KernelRows] = {}
        self._graphed = False
        # Fused experts with adapter slots (lora.experts, bound at build) read each eager
        # step's slots in use and, on the torch path, its rows as a column mask [rows,
        # rank * max_loras] (the Triton path's read `kernel_rows`).
        self.experts = False
        self.expert_mask: torch.Tensor | None = None
        self.used_slots: tuple[int, ...] = ()

    @property
    def graphed(self) -> bool:
        return self._graphed

    @graphed.setter
    def graphed(self, on: bool) -> None:
        self._graphed = on
        self._graph_rows.clear()

    def reserve(self, num_tokens: int, device: torch.device) -> None:
        """Allocate `token_slots` for up to `num_tokens` rows (the graph runner, at build)."""
        self.token_slots = torch.full((num_tokens,), self.zero_slot, dtype=torch.int64)
        self.token_slots = self.token_slots.to(device)
        self._graph_columns = stack_columns(self.max_loras, self.max_rank).to(device)

    def set_slot_rank(self, slot: int, rank: int) -> None:
        """`slot` now holds an adapter of rank `rank` (0: emptied)."""
        self.slot_ranks[slot] = rank

    def begin_step(self, plan: StepPlan, device: torch.device) -> None:
        """The plan's token rows (its chunks' tokens, in order) by adapter slot."""
        slots = [c.lora_slot for c in plan.seqs for _ in c.token_ids]
        self.set_rows(slots, device)

    def set_rows(self, slots: list[int], device: torch.device) -> None:
        self._set_static(slots)
        self._graph_rows.clear()
        if self.experts:
            self._set_expert_rows(slots, device)
        if self.kernel is None:
            self.step = resolve_step(slots, self.slot_ranks, device)
            return
        rank = step_rank(slots, self.slot_ranks)
        if rank == 0:
            self._rows = None
            return
        ids = torch.tensor(slots, dtype=torch.int64).to(device)
        self._rows = KernelRows(ids, rank, self.kernel.align(ids, self.max_loras))

    def _set_expert_rows(self, slots: list[int], device: torch.device) -> None:
        rank = step_rank(slots, self.slot_ranks)
        self.used_slots = tuple(sorted(set(slots) - {NO_ADAPTER})) if rank else ()
        self.expert_mask = None
        if rank and self.kernel is None:  # the Triton path's experts read kernel_rows
            ids = torch.tensor(slots, dtype=torch.int64)
            mask = ids[:, None] == stack_columns(self.max_loras, rank)[None, :]
            self.expert_mask = mask.to(device)

    def graph_step(self, num_rows: int) -> LoraStep:
        """The stacked step of a captured region's first `num_rows` rows, from `token_slots`."""
        assert self.token_slots is not None and self._graph_columns is not None, (
            "graph steps need LoraBatch.reserve"
        )
        rows = self.token_slots[:num_rows]
        mask = rows[:, None] == self._graph_columns[None, :]
        return LoraStep(self.max_rank, mask=mask)

    def kernel_rows(self, num_rows: int) -> KernelRows | None:
        """The Triton path's rows, None when no row has an adapter. A graph step reads the
        static buffer at the full max rank (the kernels skip the zero slot's rows)."""
        if not self._graphed:
            return self._rows
        rows = self._graph_rows.get(num_rows)
        if rows is None:
            assert self.kernel is not None and self.token_slots is not None, (
                "graph steps on the Triton path need LoraBatch.reserve"
            )
            ids = self.token_slots[:num_rows]
            rows = KernelRows(ids, self.max_rank, self.kernel.align(ids, self.max_loras))
            self._graph_rows[num_rows] = rows
        return rows

    def _set_static(self, slots: list[int]) -> None:
        """Fill `token_slots` in place (pad rows past the plan's: the zero slot). A step
        longer than the buffer never replays a graph, so it is left as is."""
        buf = self.token_slots
        if buf is None or len(slots) > buf.numel():
            return
        host = torch.full((buf.numel(),), self.zero_slot, dtype=torch.int64)
        host[: len(slots)] = torch.tensor(
            [self.zero_slot if s == NO_ADAPTER else s for s in slots], dtype=torch.int64
        )
        buf.copy_(host, non_blocking=True)
