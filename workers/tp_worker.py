"""One tensor-parallel rank as a Ray actor: model shard + state-pool shard + ModelRunner."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace

import ray
import torch
import torch.distributed as dist

from shortconv.engine.plan import StepResult
from shortconv.engine.stats import StartupReport
from shortconv.engine.step_delta import StepDelta
from shortconv.execution.parallel import ParallelContext
from shortconv.execution.persistent_batch import PersistentBatch
from shortconv.execution.runner import ModelRunner
from shortconv.execution.state_io import gather_state, scatter_state
from shortconv.execution.worker_spec import WorkerSpec
from shortconv.lora.adapter import LoraAdapter
from workers.cpu_threads import follow_reservation
from workers.dist_init import destroy_distributed, free_port, init_distributed, local_device
from workers.startup import PhaseClock

# Per-step compute times kept for benchmarks; bounded so a long-running server never grows it.
_MAX_TIMINGS = 4096


class TPWorker:
    """Rank `rank` of `world_size`. Built empty, then `setup()` joins torch.distributed and loads
    this rank's shard of the weights; `execute(delta)` applies every step's message to this
    rank's persistent batch and runs the plan it rebuilds, the same on every rank. Rank 0
    returns the StepResult, the others None.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._clock = PhaseClock()
        self.threads = follow_reservation(f"TP rank {rank}")
        self.runner: ModelRunner | None = None
        self.batch = PersistentBatch()
        self._timings: deque[tuple[int, float]] = deque(maxlen=_MAX_TIMINGS)

    def rendezvous_address(self) -> str:
        """tcp:// address on this node for the group's store (called on rank 0 only)."""
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def setup(self, init_method: str, spec: WorkerSpec, timeout_s: float) -> None:
        # NOTE: the spec names a device type; this actor's own device of that type is local.
        device = local_device(spec.device.type)
        with self._clock.phase("join"):
            init_distributed(init_method, self.rank, self.world_size, device.type, timeout_s)
        tp = ParallelContext(self.rank, self.world_size, dist.group.WORLD)
        self.runner = ModelRunner(replace(spec, device=device), tp)
        self._clock.add(self.runner.startup_s)

    def execute(self, delta: StepDelta) -> StepResult | None:
        runner = self._ready()
        t0 = time.perf_counter()
        plan = self.batch.apply(delta)
        out = runner.execute(plan)
        self._timings.append((plan.step_id, time.perf_counter() - t0))
        return out

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Write this rank's shard of `adapter` into LoRA slot `slot` (LoraError, the slot
        cleared or untouched, where it does not fit)."""
        self._ready().load_lora(slot, adapter)

    def unload_lora(self, slot: int) -> None:
        self._ready().unload_lora(slot)

    def lora_slot_sum(self, slot: int) -> float:
        """This rank's LoRA slot `slot`, summed (0 when empty; for tests)."""
        return self._ready().lora_slot_sum(slot)

    def read_state(
        self, slots: Sequence[int], pages: Sequence[Sequence[int]]
    ) -> dict[str, torch.Tensor]:
        """This rank's shard of checkpoints' state (`execution.state_io.gather_state`)."""
        return gather_state(self._ready().pool, slots, pages)

    def write_state(
        self,
        slots: Sequence[int],
        pages: Sequence[Sequence[int]],
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        """Write this rank's shard (`execution.state_io.scatter_state`: every shape checked
        before the first write)."""
        scatter_state(self._ready().pool, slots, pages, tensors)

    def _ready(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError(f"TP rank {self.rank} is not set up")
        return self.runner

    # ---- introspection (health checks, tests, benchmarks) ----------------------------------
    def ping(self) -> int:
        return self.rank

    def startup_report(self) -> StartupReport:
        """This rank's start: its process before the actor, joining the group, the runner's
        phases; its resident memory now."""
        return self._clock.report(f"TP rank {self.rank} ({self.threads} threads)")

    def torch_threads(self) -> int:
        """Torch's intra-op threads on this rank's own threads (follows its reserved CPUs)."""
        return torch.get_num_threads()

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return self._ready().state_shapes()

    def weight_bytes(self) -> dict[str, int]:
        return dict(self._ready().weight_bytes)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self._ready().model.named_parameters()}

    def last_cache_indices(self) -> list[int]:
        """The state slots this rank resolved for the latest step (must match on every rank)."""
        return self._ready().backend.step.cache_indices.tolist()

    def batch_request_ids(self) -> list[str]:
        """The requests this rank's persistent batch holds (tests: drops reach every rank)."""
        return sorted(self.batch.request_ids())

    def pop_timings(self) -> list[tuple[int, float]]:
        """(step_id, seconds inside ModelRunner.execute) since the last call."""
        out = list(self._timings)
        self._timings.clear()
        return out

    def shutdown(self) -> None:
        self.runner = None
        destroy_distributed()
