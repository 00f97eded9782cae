"""ModelRunner: one rank's model shard, state-pool shard, backend and sampler; runs StepPlans."""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from shortconv.cache.kv_groups import kv_specs
from shortconv.cache.state_pool import StatePool
from shortconv.configs.support import check_support
from shortconv.engine.images import ImageSpec
from shortconv.engine.plan import SeqChunk, StepPlan, StepResult
from shortconv.errors import ConfigError
from shortconv.execution.backend import ShortConvBackend
from shortconv.execution.encoder_cache import EncoderCache
from shortconv.execution.graph_runner import GraphRunner
from shortconv.execution.parallel import ParallelContext
from shortconv.execution.step_tensors import StepTensors
from shortconv.execution.worker_spec import WorkerSpec
from shortconv.kernels import cpu_gemm as cpu_gemm_kernels
from shortconv.layers.linear_binding import (
    LinearPolicy,
    linear_layers,
    process_linears_after_load,
)
from shortconv.layers.linear_cpu_gemm import CPU_GEMM_MAX_ROWS
from shortconv.layers.linear_rows import fp32_tile_rows
from shortconv.layers.quantize import weight_bytes
from shortconv.lora.adapter import LoraAdapter
from shortconv.lora.batch import LoraBatch
from shortconv.lora.install import clear_slot, install_adapter, slot_weight_sum
from shortconv.models.build import build_model
from shortconv.models.loader import iter_checkpoint
from shortconv.models.registry import model_class
from shortconv.sampling.sampler import Sampler
from shortconv.sampling.verify_step import DraftVerify, sample_step

log = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model shard, state-pool shard, backend and sampler, built from `spec`."""

    def __init__(self, spec: WorkerSpec, tp: ParallelContext) -> None:
        # Seconds per start-up phase, in order (the replica's start-up report reads them).
        self.startup_s: dict[str, float] = {}
        model_cfg, engine_cfg = spec.model_cfg, spec.engine_cfg
        device, dtype = spec.device, spec.dtype
        check_support(model_cfg, device, tp.size, engine_cfg.quantization)
        self.cfg, self.tp, self.device, self.dtype = model_cfg, tp, device, dtype
        cls = model_class(model_cfg.arch)
        self.lora = _lora_batch(spec, cls)
        linears = self._linear_policy(spec)
        t0 = time.perf_counter()
        model = build_model(cls, model_cfg, tp, device, dtype, linears)
        model.load_weights(iter_checkpoint(spec.model_dir))
        self.model = model
        self.startup_s["weights"] = time.perf_counter() - t0
        log.info(
            "rank %d: loaded %s weights in %.1fs",
            tp.rank,
            model_cfg.arch,
            self.startup_s["weights"],
        )
        t0 = time.perf_counter()
        process_linears_after_load(model)
        # Named by the work the hooks did (the start-up report's phases); else too short to log.
        phase = "quantize" if linears.quantization != "none" else None
        if phase is None and linears.prepack:
            phase = "prepack"
        if phase is not None:
            self.startup_s[phase] = time.perf_counter() - t0
        methods = Counter(layer.method.name for _, layer in linear_layers(model))
        log.info("rank %d: linear methods %s", tp.rank, dict(sorted(methods.items())))
        # This rank's weights by storage dtype (the start-up log; quantized layers under int8).
        self.weight_bytes = weight_bytes(model)
        log.info(
            "rank %d: weights %s",
            tp.rank,
            ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(self.weight_bytes.items())),
        )
        t0 = time.perf_counter()
        kv = kv_specs(model_cfg, tp, engine_cfg.kv_page_size, spec.capacity.pages_per_group)
        specs = cls.state_specs(model_cfg, tp)
        self.pool = StatePool(specs, kv, spec.capacity.num_slots, dtype, device)
        self.backend = ShortConvBackend(self.pool, device, cls.extra_state_name)
        self.sampler = Sampler()
        image_spec = ImageSpec.of(model_cfg)
        self.images = (
            EncoderCache(model, image_spec.downsample_factor, device) if image_spec else None
        )
        self.startup_s["state_pool"] = time.perf_counter() - t0
        self.graphs: GraphRunner | None = None
        if engine_cfg.graphs_enabled(device):
            t0 = time.perf_counter()
            # NOTE: the engine's KV-capped limit, not the model's: no bucket beyond what a
            # sequence can reach.
            self.graphs = GraphRunner(
                self.model, self.backend, engine_cfg, spec.max_model_len, tp.size, self.lora
            )
            self.graphs.capture()
            self.startup_s["graphs"] = time.perf_counter() - t0

    def _linear_policy(self, spec: WorkerSpec) -> LinearPolicy:
        """The linear layers' choices for this rank; on CPU this loads (or builds) our AVX2
        kernels first, since which layers take them, and up to how many rows, is decided at
        build."""
        cfg = spec.engine_cfg
        cpu = spec.device.type == "cpu"
        cpu_gemm, max_rows = False, CPU_GEMM_MAX_ROWS
        if cpu and (cfg.cpu_kernels or cfg.quantization != "none"):
            t0 = time.perf_counter()
            why_not = cpu_gemm_kernels.load()
            if why_not is not None and cfg.quantization != "none":
                raise ConfigError(f"quantization={cfg.quantization!r}: {why_not}")
            cpu_gemm = why_not is None and cfg.cpu_kernels
            self.startup_s["cpu_kernels"] = time.perf_counter() - t0
            used = f"not used ({why_not or 'cpu_kernels off'})"
            if cpu_gemm:
                isa = cpu_gemm_kernels.set_isa()
                max_rows = fp32_tile_rows(isa)
                used = (
                    f"fp32 linear layers up to {max_rows} rows (the {isa} tile set's row "
                    "table), torch's linears above"
                )
            log.info("rank %d: CPU GEMM kernels: %s", self.tp.rank, used)
        return LinearPolicy(
            quantization=cfg.quantization,
            quantize_lm_head=cfg.quantize_lm_head,
            cpu_gemm=cpu_gemm,
            cpu_gemm_max_rows=max_rows,
            prepack=cfg.prepack_cpu_weights and cpu,
            lora=self.lora,
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one step; rank 0 returns the sampled tokens, other ranks return None."""
        if plan.copies_before:  # before either path: a resumed row reads its copied state
            self._copy(plan.copies_before)
        for group, pairs in plan.page_copies_by_group():
            self.pool.copy_pages(self._ids(pairs, 0), self._ids(pairs, 1), group)
        encoder_before = self.images.seconds if self.images is not None else 0.0
        encoder_s = 0.0  # this step's encoder time (a step with images only)
        if self.lora is not None:
            self.lora.begin_step(plan, self.device)
        if self.graphs is not None and self.graphs.accepts(plan):
            decoded = self.graphs.run(plan)
            hidden_rows, used_graph = decoded.hidden, decoded.used_graph
        else:
            step = self.backend.begin_step(plan)
            hidden = self._forward(plan, step)
            # A decode step samples every row: skip the identity gather.
            every = step.is_decode and step.logits_indices.numel() == step.num_tokens
            hidden_rows = hidden if every else hidden[step.logits_indices]
            used_graph = False
        if plan.copies_after:
            self._copy(plan.copies_after)
        if self.images is not None:
            self.images.free(plan.encoder_frees)
            encoder_s = self.images.seconds - encoder_before
        samples = [x for s in plan.seqs for x in s.samples]
        if not samples:
            empty = StepResult(plan.step_id, (), (), (), (), used_graph, encoder_s)
            return empty if self.tp.rank == 0 else None
        logits = self.model.compute_logits(hidden_rows)
        if self.tp.rank != 0:
            return None
        rows = [row for _, row in samples]
        out = sample_step(self.sampler, _per_sample(logits, plan), rows, _draft_verifies(plan))
        ids = tuple(rid for rid, _ in samples)
        tokens, logprobs, tops = tuple(out.token_ids), tuple(out.logprobs), tuple(out.top_logprobs)
        return StepResult(plan.step_id, ids, tokens, logprobs, tops, used_graph, encoder_s)

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` into LoRA slot `slot` of every layer (this rank's shard)."""
        assert self.lora is not None, "load_lora needs enable_lora"
        renames = self.model.hf_to_ours()
        install_adapter(self.model, renames, slot, adapter, self.tp)
        self.lora.set_slot_rank(slot, adapter.tensor_rank)

    def unload_lora(self, slot: int) -> None:
        """Empty LoRA slot `slot` in every layer (an unloaded adapter leaves nothing behind)."""
        assert self.lora is not None, "unload_lora needs enable_lora"
        clear_slot(self.model, slot)
        self.lora.set_slot_rank(slot, 0)

    def lora_slot_sum(self, slot: int) -> float:
        """`lora.install.slot_weight_sum` of this rank's shard: 0 once `slot` is empty."""
        return slot_weight_sum(self.model, slot)

    def _forward(self, plan: StepPlan, step: StepTensors) -> torch.Tensor:
        """NOTE: the one place a step's input stops being token ids only: a plan with images
        encodes its new ones and replaces their placeholders' embeddings before layer 0."""
        if not plan.has_images:
            return self.model(step.input_ids, self.backend)
        if self.images is None:
            raise ValueError(f"{self.cfg.arch} takes no images")
        embeds = self.images.step_embeddings(plan, step)
        return self.model(step.input_ids, self.backend, inputs_embeds=embeds)

    def _copy(self, pairs: tuple[tuple[int, int], ...]) -> None:
        self.pool.copy_slots(self._ids(pairs, 0), self._ids(pairs, 1))

    def _ids(self, pairs: tuple[tuple[int, int], ...], col: int) -> torch.Tensor:
        return torch.tensor([p[col] for p in pairs], dtype=torch.int64, device=self.device)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {k: tuple(v.shape) for k, v in self.pool.states.items()}
        for g, caches in enumerate(self.pool.kv_caches):
            if caches is not None:
                shapes["kv" if g == 0 else f"kv{g}"] = tuple(caches[0].shape)
        return shapes


def _lora_batch(spec: WorkerSpec, cls: type) -> LoraBatch | None:
    """The model's LoRA rows where LoRA is enabled; what it does not cover yet is refused."""
    cfg = spec.engine_cfg
    if not cfg.enable_lora:
        return None
    # NOTE: a vision model's encoder and projector are plain nn.Linear, never LoRA layers:
    # only its language model (LinearBase projections) is adaptable.
    if not hasattr(cls, "hf_to_ours"):
        raise ConfigError(f"enable_lora: {spec.model_cfg.arch} is not supported yet")
    return LoraBatch(cfg.max_loras, cfg.max_lora_rank, spec.device)


def _per_sample(logits: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """One logits row per sampled token: a forking parent's one row repeated once per fork (an
    index_select; the forward and the LM head ran once for the shared position); a verify
    row's k + 1 rows each once."""
    counts = [c for s in plan.seqs for c in _repeats(s)]
    if all(c == 1 for c in counts):
        return logits
    rows = [i for i, c in enumerate(counts) for _ in range(c)]
    return logits.index_select(0, torch.tensor(rows, dtype=torch.int64, device=logits.device))


def _draft_verifies(plan: StepPlan) -> list[DraftVerify]:
    """The verify rows that carry a draft distribution, by their first sample's index."""
    out, at = [], 0
    for s in plan.seqs:
        if s.draft_probs is not None:
            out.append(DraftVerify(at, s.token_ids[s.num_tokens - s.num_draft :], s.draft_probs))
        at += len(s.samples)
    return out


def _repeats(chunk: SeqChunk) -> list[int]:
    """How many sampled tokens each of the chunk's logits rows answers for."""
    if chunk.fork_rows:
        return [len(chunk.fork_rows)]
    return [1] * chunk.num_logits
