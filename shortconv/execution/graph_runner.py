"""Graph-captured decode and verify over ladders of (batch, context) buckets.

Every decode step is padded to a bucket: B = the smallest `graph_batch_sizes` entry >= its
rows, L = the smallest context bucket >= its longest context. Rows past the plan are scratch
rows (slot 0, page 0: the padding contract in `step_inputs`). A bucket's step tensors are the
backend's own step inputs (`StepInputs`) viewed at the bucket's size.

Context buckets depend on the attention path; the kernel dispatch names them once, at
construction (`kernels.dispatch.attention_context_buckets`):

* torch path (CPU): decode attention gathers each row's context into `[B, L]` and masks it; a
  captured step needs that L fixed. One L = max_model_len would make every step pay for the
  longest possible context (128k positions for LFM2), so L is bucketed (`graph_context_sizes`,
  doubling by default: at most 2x waste) and contexts past the largest bucket run eagerly, like
  vLLM's `max_seq_len_to_capture`.
* Triton path (CUDA, or SHORTCONV_KERNELS=triton): the paged decode kernel reads only
  `block_tables` `[B, ceil(L / page)]` and bounds each row's work by its own seq_lens (its
  splits divide the row's context, not the table), and builds no `[B, L]` gather or mask. So
  one context bucket, the engine's KV-capped max_model_len, covers every
  decode step: one graph per batch bucket, and no decode step falls back for its length.

Verify steps (speculative decoding, up to k proposals a row) have their own ladders: the same
(batch, context) buckets at each width 2..k + 1, every row of a bucket that many tokens. A
verify row is an extend row (the conv and attention extend kernels, `max_query_len` = its width:
static) that also writes its spec-slot checkpoints (`execution/state_checkpoints`); those slot
ids live in the bucket's primary block, rewritten in place by every refresh, so the captured
region reads them like the rest of the step. Only steps whose rows all have one width replay
(batch 1 always does): a row is not padded to a wider bucket, because tokens past a row's own
would advance its live conv state past them. A step that mixes widths (a plain decode row beside
a verify row, rows with different numbers of proposals) runs eagerly, counted as `mixed_width`.
Decode-only steps keep the width-1 ladder: padding a decode row to k + 1 tokens would cost every
decode step (k + 1)x the tokens. The price is k + 1 ladders of graphs instead of one (capture
time and, on CUDA, graph memory; the step buffers are shared).

On CUDA each shape is captured once at start-up (largest first, one shared memory pool) and
replayed; on CPU "capture" only prepares the bucket's views and a replay runs the same forward
eagerly on them, so CI tests the same buffer, padding and refresh protocol.

Replay failures. The metadata refresh runs before anything touches state; a failure there
changes nothing. Before a replay the runner snapshots every state kind (conv, ZAYA1's
prev_state) of the step's slots, a verify step's spec slots included; if the replay raises
(on CPU possibly after some layers updated state in place) those slots are restored and the
step is recomputed eagerly. KV pages
need no snapshot: a step writes only its rows' new positions, and the eager recompute rewrites
each of them before any attention reads it. Not covered: asynchronous device faults (a sticky
CUDA error leaves no usable context; the step raises). With tp_size > 1 a failed rank restores
its state and re-raises instead of falling back, because a one-rank eager step would run its
collectives with different shapes from the ranks that replayed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from shortconv.configs.config import EngineConfig
from shortconv.engine.plan import StepPlan
from shortconv.engine.stats import GraphStats
from shortconv.errors import ConfigError
from shortconv.execution.backend import ShortConvBackend
from shortconv.execution.step_inputs import DecodeShape
from shortconv.kernels.dispatch import attention_context_buckets, resolve_backend
from shortconv.lora.batch import LoraBatch

log = logging.getLogger(__name__)

FAILURE_PHASES = ("prepare", "replay")
FALLBACK_REASONS = ("no_bucket", "mixed_width", "replay_error")


@dataclass(frozen=True)
class DecodeOutput:
    """Final hidden rows of the plan's sampled chunks, in plan order. After a replay on CUDA
    this is a view of the graph's output: consume it before the next step."""

    hidden: torch.Tensor
    used_graph: bool


def batch_buckets(sizes: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """Sorted buckets, dropping those above the smallest one that covers max_num_seqs."""
    ladder = sorted({int(b) for b in sizes})
    if not ladder or ladder[0] < 1:
        raise ConfigError(f"graph_batch_sizes must be positive integers, got {sizes}")
    covering = [b for b in ladder if b >= max_num_seqs]
    return tuple(b for b in ladder if b < max_num_seqs) + tuple(covering[:1])


def context_buckets(sizes: tuple[int, ...], max_model_len: int) -> tuple[int, ...]:
    """Sorted context buckets, each capped at max_model_len."""
    ladder = sorted({min(int(c), max_model_len) for c in sizes})
    if not ladder or ladder[0] < 1:
        raise ConfigError(f"graph_context_sizes must be positive integers, got {sizes}")
    return tuple(ladder)


class GraphRunner:
    """Runs decode plans as replays of captured steps; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        backend: ShortConvBackend,
        engine_cfg: EngineConfig,
        max_model_len: int,
        tp_size: int = 1,
        lora: LoraBatch | None = None,
    ) -> None:
        self.model, self.backend, self.pool = model, backend, backend.pool
        self.lora = lora
        self.device = backend.device
        self.tp_size = tp_size
        self.use_cuda_graphs = self.device.type == "cuda"
        self.batch_sizes = batch_buckets(engine_cfg.graph_batch_sizes, engine_cfg.max_num_seqs)
        ladder = context_buckets(engine_cfg.graph_context_sizes, max_model_len)
        self.context_sizes = attention_context_buckets(self.device, ladder, max_model_len)
        self.inputs = backend.inputs
        # NOTE: bound once: the widest verify ladder (1: no speculation, decode only).
        self.verify_width = engine_cfg.num_speculative_tokens + 1
        # Room for every bucket and every eager step before anything is captured.
        b = self.batch_sizes[-1]
        max_tokens = max(engine_cfg.max_num_batched_tokens, b * self.verify_width)
        self.inputs.reserve(
            max_tokens,
            max(engine_cfg.max_num_seqs, b),
            max(max_model_len, self.context_sizes[-1]),
        )
        if lora is not None:  # each token row's adapter slot, read in place by every replay
            lora.reserve(max_tokens, self.device)
        # NOTE: modules that sync the host on their default path (FusedExperts) expose a
        # `capture_safe` flag; it is on only while a captured step is recorded or run.
        self._capture_safe = [m for m in model.modules() if hasattr(m, "capture_safe")]
        self._graphs: dict[DecodeShape, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[DecodeShape, torch.Tensor] = {}
        self._ready: set[DecodeShape] = set()
        self._replays = 0
        self._verify_replays = 0
        self._failures = dict.fromkeys(FAILURE_PHASES, 0)
        self._fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)
        self._capture_seconds = 0.0

    # ---- start-up -----------------------------------------------------------------------
    def shapes(self) -> list[DecodeShape]:
        """Every captured shape, largest first (the order they are captured in): the verify
        ladder's, then the decode ladder's."""
        batches, contexts = self.batch_sizes[::-1], self.context_sizes[::-1]
        widths = range(self.verify_width, 0, -1)
        return [DecodeShape(b, c, w) for w in widths for b in batches for c in contexts]

    @torch.inference_mode()
    def capture(self) -> None:
        shapes = self.shapes()
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        log.info(
            "capturing %d graphs: batch sizes %s x context sizes %s x widths %s (%s kernels)",
            len(shapes),
            list(self.batch_sizes),
            list(self.context_sizes),
            list(range(1, self.verify_width + 1)),
            resolve_backend(self.device),
        )
        start = time.perf_counter()
        for k, shape in enumerate(shapes, 1):
            t0 = time.perf_counter()
            self.inputs.graph_step(shape)  # builds the views once
            if self.use_cuda_graphs:
                self._capture_cuda(shape, pool)
            self._ready.add(shape)
            now = time.perf_counter()
            log.info(
                "graph %d/%d (batch %d, context %d, width %d) %s in %.1f ms, elapsed %.2f s",
                k,
                len(shapes),
                shape.batch,
                shape.context,
                shape.width,
                "captured" if self.use_cuda_graphs else "prepared",
                1e3 * (now - t0),
                now - start,
            )
        self.inputs.freeze()
        self._capture_seconds = time.perf_counter() - start
        log.info("%d graphs ready in %.2f s", len(shapes), self._capture_seconds)

    def _capture_cuda(self, shape: DecodeShape, pool: tuple[int, int] | None) -> None:
        self.inputs.refresh(None, shape)  # all scratch rows: warm-up touches no live state
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(shape)  # compiles Triton kernels, creates cuBLAS workspaces
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(shape)
        except Exception as exc:
            raise RuntimeError(
                f"graph capture failed for batch {shape.batch}, context {shape.context}, "
                f"width {shape.width}: {exc}. Start with enable_graphs=False to run eagerly."
            ) from exc
        self._graphs[shape], self._outputs[shape] = graph, out

    # ---- stepping -----------------------------------------------------------------------
    def shape_for(self, plan: StepPlan) -> DecodeShape | None:
        """The bucket a plan of one row width pads to, or None when it exceeds the ladder."""
        rows, width = len(plan.seqs), plan.seqs[0].num_tokens
        ctx = max(s.start_pos + s.num_tokens for s in plan.seqs)
        b = next((x for x in self.batch_sizes if x >= rows), None)
        c = next((x for x in self.context_sizes if x >= ctx), None)
        if b is None or c is None or DecodeShape(b, c, width) not in self._ready:
            return None
        return DecodeShape(b, c, width)

    def accepts(self, plan: StepPlan) -> bool:
        """A plan this runner takes: decode rows, or verify rows (mixed widths included)."""
        return bool(plan.seqs) and (plan.is_decode or plan.is_verify) and not plan.has_images

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> DecodeOutput:
        """One decode or verify step: replay its bucket, or run eagerly (counted) when none
        fits."""
        if not self.accepts(plan):
            raise ValueError("GraphRunner.run takes non-empty decode or verify plans only")
        if len({s.num_tokens for s in plan.seqs}) > 1:
            return self._eager(plan, "mixed_width")
        shape = self.shape_for(plan)
        if shape is None:
            return self._eager(plan, "no_bucket")
        try:
            self.inputs.refresh(plan, shape)
        except Exception as exc:
            return self._failed(plan, "prepare", exc, None)
        snapshot = self._snapshot(shape)
        try:
            hidden = self._replay(shape)
        except Exception as exc:
            return self._failed(plan, "replay", exc, snapshot)
        self._replays += 1
        self._verify_replays += shape.width > 1
        return DecodeOutput(_sampled_rows(hidden, plan, shape.width), True)

    def _replay(self, shape: DecodeShape) -> torch.Tensor:
        if not self.use_cuda_graphs:
            return self._forward(shape)
        self._graphs[shape].replay()
        self.backend.bind(self.inputs.graph_step(shape))  # keep backend.step coherent for readers
        return self._outputs[shape]

    def _forward(self, shape: DecodeShape) -> torch.Tensor:
        """The captured region: derive the step tensors, then the model forward."""
        step = self.inputs.graph_step(shape)
        self.inputs.derive(shape)
        self.backend.bind(step)
        with self.static_shapes():
            return self.model(step.input_ids, self.backend)

    @contextmanager
    def static_shapes(self) -> Iterator[None]:
        """Switch the model's capture-safe paths on (tests use it for same-path references)."""
        for m in self._capture_safe:
            m.capture_safe = True
        if self.lora is not None:
            self.lora.graphed = True
        try:
            yield
        finally:
            for m in self._capture_safe:
                m.capture_safe = False
            if self.lora is not None:
                self.lora.graphed = False

    def _snapshot(self, shape: DecodeShape) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # Pad rows repeat slot 0; their copies are taken at one instant, so restoring them all
        # writes one identical value and stays deterministic. A verify step also writes its
        # spec slots (their checkpoints): those are snapshotted with the live ones.
        step = self.inputs.graph_step(shape)
        ck = step.checkpoints
        slots = step.cache_indices if ck is None else torch.cat([step.cache_indices, ck.slot])
        slots = slots.clone()
        return slots, {k: t.index_select(1, slots) for k, t in self.pool.states.items()}

    def _restore(self, snapshot: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        slots, saved = snapshot
        for name, values in saved.items():
            self.pool.states[name].index_copy_(1, slots, values)

    def _failed(
        self,
        plan: StepPlan,
        phase: str,
        exc: Exception,
        snapshot: tuple[torch.Tensor, dict[str, torch.Tensor]] | None,
    ) -> DecodeOutput:
        if snapshot is not None:
            self._restore(snapshot)
        self._failures[phase] += 1
        log.warning(
            "decode graph %s failed for step %d (%d rows): %s: %s; state restored",
            phase,
            plan.step_id,
            len(plan.seqs),
            type(exc).__name__,
            exc,
        )
        if self.tp_size > 1:
            raise exc
        return self._eager(plan, "replay_error")

    def _eager(self, plan: StepPlan, reason: str) -> DecodeOutput:
        self._fallbacks[reason] += 1
        step = self.backend.begin_step(plan)
        hidden = self.model(step.input_ids, self.backend)
        return DecodeOutput(hidden[step.logits_indices], False)

    def stats(self) -> GraphStats:
        return GraphStats(
            num_graphs=len(self._ready),
            capture_seconds=self._capture_seconds,
            replays=self._replays,
            verify_replays=self._verify_replays,
            replay_failures=dict(self._failures),
            eager_fallbacks=dict(self._fallbacks),
        )


def _sampled_rows(hidden: torch.Tensor, plan: StepPlan, width: int) -> torch.Tensor:
    """The hidden rows the plan samples: a decode row's one token, a verify row's k + 1 (the
    bucket's row b starts at token b * width)."""
    rows = [
        b * width + i for b, s in enumerate(plan.seqs) for i in range(width - s.num_logits, width)
    ]
    if rows == list(range(len(rows))):
        return hidden[: len(rows)]  # the usual decode step: every live row samples
    return hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)]
