"""RayExecutor: one TPWorker actor per rank, the same step message to all of them every step
(the plan encoded against the ranks' persistent batches: `engine.delta_encoder`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shortconv.cache.kv_groups import kv_specs
from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.configs.support import check_support
from shortconv.engine.delta_encoder import StepDeltaEncoder
from shortconv.engine.executor import BaseExecutor, ExecutorError
from shortconv.engine.plan import StepPlan, StepResult
from shortconv.engine.stats import StartupReport
from shortconv.engine.step_delta import StepDelta
from shortconv.errors import ConfigError
from shortconv.execution.parallel import ParallelContext
from shortconv.execution.state_shards import state_shards
from shortconv.execution.worker_spec import WorkerSpec
from shortconv.lora.adapter import LoraAdapter, LoraError
from shortconv.models.registry import model_class
from workers.cpu_threads import reserved_cpus
from workers.ray_runtime import acquire_runtime, release_runtime
from workers.step_dispatch import (
    ActorCallDispatch,
    BaseDispatch,
    CompiledGraphDispatch,
    dead_ranks,
    describe,
    wait_ranks,
)
from workers.tp_worker import TPWorker

log = logging.getLogger(__name__)

DEFAULT_WORKER_CPUS = 0.5  # logical CPUs Ray reserves per rank; torch threads are separate


def worker_bundles(tp_size: int, device_type: str, num_cpus: float = DEFAULT_WORKER_CPUS) -> list:
    """Placement-group bundles for the ranks (index = rank); Serve builders reuse this."""
    bundle: dict[str, float] = {"CPU": num_cpus}
    if device_type == "cuda":
        bundle["GPU"] = 1
    return [dict(bundle) for _ in range(tp_size)]


def bundle_cpus(bundles: list[dict[str, float]], own: float) -> list[float]:
    """Each rank's CPUs in a group whose bundle 0 also holds the caller (`own` CPUs)."""
    return [max(0.0, b.get("CPU", 0.0) - (own if i == 0 else 0.0)) for i, b in enumerate(bundles)]


def check_tp_shards(model_cfg: ModelConfig, engine_cfg: EngineConfig, tp_size: int) -> None:
    """Build the rank-0 model on the meta device: every dimension a layer shards is checked by
    the layer itself, so a new architecture's split (e.g. CCA head groups) is refused here,
    before any actor exists, with the layer's message naming the dimension.

    A dry run that cannot run at all (a layer that does not build on the meta device) raises
    too: a pre-flight check that silently does nothing would let a bad split reach the ranks."""
    cls = model_class(model_cfg.arch)
    tp = ParallelContext(0, tp_size)
    try:
        with torch.device("meta"):
            cls(model_cfg, tp)
        cls.state_specs(model_cfg, tp)
        kv_specs(model_cfg, tp, engine_cfg.kv_page_size, 2)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{model_cfg.arch}: {exc}") from exc
    except Exception as exc:
        raise RuntimeError(
            f"the tp_size={tp_size} pre-flight check of {model_cfg.arch} could not run: building "
            f"rank 0's model on the meta device raised {type(exc).__name__}: {exc}. Every layer "
            "must build on the meta device, so that its shards are checked before workers start."
        ) from exc


class RayExecutor(BaseExecutor):
    """Owns `tp_size` TPWorker actors placed one per bundle of a placement group.

    Inside a Serve replica the workers go into the replica's placement group (bundle index =
    rank), which the replica's engine core process is given as `replica_group`; elsewhere
    the executor creates a STRICT_PACK group of its own. A worker that dies or raises makes the
    next `execute` raise ExecutorError within `step_timeout_s`; the executor then stays failed
    (its collectives are unusable) and releases its workers at once.

    `dispatch="compiled"` (default) drives the ranks through a Ray Compiled Graph; "actor" uses
    one plain actor call per rank per step. On 2 CPU cores at tp_size=2 the compiled graph adds
    about 1.3-1.6 ms per step against 2.0-3.5 ms for actor calls (bench/tp_overhead.py).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        tp_size: int = 2,
        *,
        dispatch: str = "compiled",
        num_cpus_per_worker: float = DEFAULT_WORKER_CPUS,
        step_timeout_s: float = 120.0,
        start_timeout_s: float = 300.0,
        replica_group: PlacementGroup | None = None,
        caller_cpus: float | None = None,
    ) -> None:
        # NOTE: every refusal happens before Ray is touched, so a bad tp_size costs nothing.
        check_support(spec.model_cfg, spec.device, tp_size, spec.engine_cfg.quantization)
        check_tp_shards(spec.model_cfg, spec.engine_cfg, tp_size)
        if dispatch not in ("actor", "compiled"):
            raise ConfigError(f"dispatch must be 'actor' or 'compiled', got {dispatch!r}")
        self.tp_size = tp_size
        self._shards = state_shards(spec.model_cfg, tp_size)  # bound once: export/import
        self.step_timeout_s, self.start_timeout_s = step_timeout_s, start_timeout_s
        self.workers: list[Any] = []
        self._dispatch: BaseDispatch | None = None
        self._pg: PlacementGroup | None = None
        self._owns_pg = False
        self._error: str | None = None
        self._closed = False
        self.encoder = StepDeltaEncoder()
        self.last_message: StepDelta | None = None  # the latest step's message (tests, benches)
        self._owns_runtime = acquire_runtime(num_cpus=tp_size * num_cpus_per_worker)
        try:
            self._start(spec.device.type, num_cpus_per_worker, replica_group, caller_cpus)
            self._setup_workers(spec)
            cls = CompiledGraphDispatch if dispatch == "compiled" else ActorCallDispatch
            self._dispatch = cls(self.workers, step_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up ---------------------------------------------------------------------------
    def _start(
        self,
        device_type: str,
        num_cpus: float,
        group: PlacementGroup | None,
        caller_cpus: float | None,
    ) -> None:
        """Place the ranks: in `group` (a replica's, given to its engine core process, which
        holds `caller_cpus` of bundle 0), else in the caller's own group, else in a new one."""
        bundles = worker_bundles(self.tp_size, device_type, num_cpus)
        pg = group if group is not None else ray.util.get_current_placement_group()
        if pg is None:
            pg, self._owns_pg = placement_group(bundles, strategy="STRICT_PACK"), True
        elif len(pg.bundle_specs) < self.tp_size:
            raise ConfigError(
                f"the current placement group has {len(pg.bundle_specs)} bundles but "
                f"tp_size={self.tp_size} needs one per rank"
            )
        self._pg = pg
        self._get(pg.ready(), self.start_timeout_s, f"placement group {bundles} never fit")
        # NOTE: in a group of the caller's (a Serve replica's) each rank takes what its bundle
        # holds, less the caller's own share of bundle 0: the deployment sized the bundles.
        cpus = [num_cpus] * self.tp_size
        if not self._owns_pg:
            own = caller_cpus if caller_cpus is not None else reserved_cpus() or 0.0
            cpus = bundle_cpus(pg.bundle_specs[: self.tp_size], own)
        actor_cls = ray.remote(TPWorker)
        for rank in range(self.tp_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=rank,
            )
            opts: dict[str, Any] = {"num_cpus": cpus[rank], "scheduling_strategy": strategy}
            if device_type == "cuda":
                opts["num_gpus"] = 1
            worker = actor_cls.options(name=None, max_restarts=0, **opts).remote(rank, self.tp_size)
            self.workers.append(worker)

    def _setup_workers(self, spec: WorkerSpec) -> None:
        init_method = self._get(
            self.workers[0].rendezvous_address.remote(),
            self.start_timeout_s,
            "rank 0 never started",
        )
        # NOTE: collectives get the step timeout, so a rank whose peer vanished gives up too.
        refs = [w.setup.remote(init_method, spec, self.step_timeout_s) for w in self.workers]
        self._get(refs, self.start_timeout_s, "TP workers did not finish loading")
        log.info("TP group of %d ranks ready at %s", self.tp_size, init_method)

    @staticmethod
    def _get(refs: Any, timeout_s: float, what: str) -> Any:
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError as exc:
            raise ExecutorError(f"{what} within {timeout_s:.0f}s") from exc
        except RayActorError as exc:
            raise ExecutorError(f"{describe(exc)} during start-up") from exc

    # ---- stepping ---------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        if self._error is not None:
            raise ExecutorError(self._error)
        if self._dispatch is None:
            raise ExecutorError("executor is shut down")
        # NOTE: encoded even if the send fails: a failed executor never steps again.
        self.last_message = self.encoder.encode(plan)
        try:
            result = self._dispatch.run(self.last_message)
        except ExecutorError as exc:
            self._fail(str(exc))
            raise ExecutorError(self._error or str(exc)) from exc
        if result is None:
            self._fail(f"TP rank 0 returned no result for step {plan.step_id}")
            raise ExecutorError(self._error or "")
        return result

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Every rank writes its own shard of `adapter` into `slot` (`lora.install`), between
        steps: the engine calls this from its step loop, never during one.

        NOTE: the adapter goes to the object store once, as its checked file index (no
        weights), and every rank reads only its own shard from the file (lora.shard_read); a
        refusal (the same on every rank: the checks see each rank's shard shapes) comes
        back as the rank's LoraError, not Ray's wrapper."""
        ref = ray.put(adapter)
        try:
            self.call_workers("load_lora", slot, ref)
        except RayTaskError as exc:
            # The refusal's reason (a metrics label) travels with it, not only its message.
            if isinstance(exc.cause, LoraError):
                raise LoraError(str(exc.cause), exc.cause.reason) from None
            raise

    def unload_lora(self, slot: int) -> None:
        self.call_workers("unload_lora", slot)

    def read_state(
        self, slots: Sequence[int], pages: Sequence[Sequence[int]]
    ) -> dict[str, torch.Tensor]:
        """Every rank's shard, gathered into the unsharded layout a bundle carries
        (`execution.state_shards`), between steps like `load_lora`."""
        return self._shards.gather(self._move_state("read_state", [(slots, pages)] * self.tp_size))

    def write_state(
        self,
        slots: Sequence[int],
        pages: Sequence[Sequence[int]],
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        """Cut each rank's shard out of unsharded `tensors` and write it. NOTE: dim 2 (the
        sharded one) is checked here and every other dim, equal on all ranks, by each rank
        before its first write, so a bundle that does not fit writes nothing anywhere."""
        parts = self._shards.scatter(tensors)
        self._move_state("write_state", [(slots, pages, p) for p in parts])

    def _move_state(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """`method` on every rank with its own `args`. A rank that dies, fails or hangs fails
        the executor, as a step would (its group cannot be trusted after it), and the error
        names the rank; a rank's ValueError (a tensor that does not fit, refused before any
        write) comes back as itself and leaves the executor working."""
        if self._error is not None:
            raise ExecutorError(self._error)
        if not self.workers:
            raise ExecutorError("executor is shut down")
        refs = [getattr(w, method).remote(*a) for w, a in zip(self.workers, args, strict=True)]
        try:
            return wait_ranks(refs, self.step_timeout_s, f"{method}()", (ValueError,))
        except ExecutorError as exc:
            self._fail(str(exc))
            raise ExecutorError(self._error or str(exc)) from exc

    def check_health(self) -> None:
        """Raise ExecutorError when a rank is dead. A rank busy with a long step is not
        unhealthy (a slow step is bounded by the step timeout instead), so only deaths count."""
        if self._error is not None:
            raise ExecutorError(self._error)
        if not self.workers:
            raise ExecutorError("executor is shut down")
        dead = dead_ranks(self.workers, timeout_s=10.0)
        if dead:
            self._fail(f"TP rank {dead[0]} died (found by a health check)")
            raise ExecutorError(self._error or "")

    def _fail(self, message: str) -> None:
        """Remember the first failure and free the workers: the group cannot be trusted again."""
        if self._error is None:
            self._error = f"tensor-parallel executor failed: {message}"
            log.error("%s", self._error)
        self._release_workers()

    # ---- introspection ----------------------------------------------------------------------
    def call_workers(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every rank (rank order) and wait; for tests and benchmarks."""
        if not self.workers:
            raise ExecutorError(self._error or "executor is shut down")
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return self._get(refs, self.step_timeout_s, f"TP workers did not answer {method}()")

    def state_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        return self.call_workers("state_shapes")

    def weight_bytes(self) -> dict[str, int]:
        return self._get(
            [self.workers[0].weight_bytes.remote()], self.step_timeout_s, "TP rank 0's weights"
        )[0]

    def startup_reports(self) -> list[StartupReport]:
        """Each rank's start-up phases and resident memory (rank order)."""
        return self.call_workers("startup_report")

    # ---- shutdown ---------------------------------------------------------------------------
    def _release_workers(self) -> None:
        workers, self.workers = self.workers, []
        dispatch, self._dispatch = self._dispatch, None
        graceful = self._error is None
        if not graceful:
            # NOTE: kill first: a surviving rank may sit in a collective with a dead peer and
            # would hold up a graceful teardown until the collective timeout.
            _kill_all(workers)
        if dispatch is not None:
            dispatch.close()
        if workers and graceful:
            try:  # tidy: leave the process group before the process goes
                ray.get([w.shutdown.remote() for w in workers], timeout=5.0)
            except (RayError, GetTimeoutError):
                pass
            _kill_all(workers)
        if self._pg is not None and self._owns_pg:
            try:
                remove_placement_group(self._pg)
            except (RayError, ValueError):
                pass
        self._pg = None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if ray.is_initialized():
            self._release_workers()
        if self._owns_runtime:
            self._owns_runtime = False
            release_runtime()


def _kill_all(workers: list[Any]) -> None:
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except (RayError, ValueError):
            pass
