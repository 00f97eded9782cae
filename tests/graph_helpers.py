"""Shared helpers for the graph-runner tests: tiny runners, hand-built plans, pool snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from shortconv.cache.kv_groups import kv_groups
from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.execution.graph_runner import GraphRunner
from shortconv.execution.parallel import SINGLE
from shortconv.execution.runner import ModelRunner
from shortconv.execution.step_inputs import StepInputs
from shortconv.execution.step_tensors import StepTensors
from shortconv.execution.worker_spec import Capacity, WorkerSpec
from shortconv.sampling.sampler import SamplingRow
from shortconv.sampling.sampling_params import SamplingParams

PAGE = 4
PAGES_PER_SEQ = 24  # 96 positions
NUM_SEQS = 8
CONTEXTS = (16, 32, 64)
GREEDY_ROW = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)
# Slots in scrambled order so a row index never equals its slot.
SLOTS = (5, 2, 8, 1, 7, 3, 6, 4)


def zaya_skip_reason() -> str | None:
    """Why ZAYA1 cases must skip, or None. The one documented case: the installed transformers
    (which builds the tiny checkpoints) has no `zaya` model type. Anything else that breaks
    ZAYA1 (an import error in our own model, say) fails the test instead of skipping it."""
    return transformers_lacks("zaya")


def engine_config(enable_graphs: bool = True, **kw: object) -> EngineConfig:
    base: dict[str, object] = dict(
        max_num_seqs=NUM_SEQS,
        kv_page_size=PAGE,
        enable_graphs=enable_graphs,
        graph_batch_sizes=(1, 2, 4, 8),
        graph_context_sizes=CONTEXTS,
    )
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def make_runner(path: Path, enable_graphs: bool = True, **kw: object) -> ModelRunner:
    cfg = ModelConfig.from_dir(path)
    pages = 1 + NUM_SEQS * PAGES_PER_SEQ  # every KV group: a sliding one keeps every page here
    cap = Capacity(NUM_SEQS + 2, pages, (pages,) * (len(kv_groups(cfg)) - 1))
    eng = engine_config(enable_graphs, **kw)
    cpu, f32 = torch.device("cpu"), torch.float32
    return ModelRunner(WorkerSpec(path, cfg, eng, cap, f32, cpu, cfg.max_model_len), SINGLE)


def graph_runner(runner: ModelRunner, batch_sizes: tuple[int, ...]) -> GraphRunner:
    """A fresh GraphRunner over the runner's model and pool with its own bucket ladder."""
    eng = engine_config(graph_batch_sizes=batch_sizes, max_num_seqs=max(batch_sizes))
    g = GraphRunner(runner.model, runner.backend, eng, runner.cfg.max_model_len)
    g.capture()
    return g


def window_groups(runner: ModelRunner) -> int:
    """The runner's sliding-window KV groups (hand-built plans give each a table)."""
    return runner.backend.inputs.num_kv_groups - 1


@dataclass
class Seqs:
    """Hand-driven requests: token history per row, fixed slots and pages (the same page ids
    in every sliding-window KV group, none freed: a valid table for any window)."""

    tokens: list[list[int]]
    window_groups: int = 0
    step_id: int = 0
    pages: list[tuple[int, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pages = [
            tuple(range(1 + i * PAGES_PER_SEQ, 1 + (i + 1) * PAGES_PER_SEQ))
            for i in range(len(self.tokens))
        ]

    def prefill(self) -> StepPlan:
        chunks = tuple(
            SeqChunk(
                f"r{i}",
                tuple(t),
                0,
                SLOTS[i],
                self.pages[i],
                GREEDY_ROW,
                window_tables=(self.pages[i],) * self.window_groups,
            )
            for i, t in enumerate(self.tokens)
        )
        return self._plan(chunks)

    def decode(self, rows: list[int]) -> StepPlan:
        chunks = tuple(
            SeqChunk(
                f"r{i}",
                (self.tokens[i][-1],),
                len(self.tokens[i]) - 1,
                SLOTS[i],
                self.pages[i],
                GREEDY_ROW,
                window_tables=(self.pages[i],) * self.window_groups,
            )
            for i in rows
        )
        return self._plan(chunks)

    def _plan(self, chunks: tuple[SeqChunk, ...]) -> StepPlan:
        self.step_id += 1
        return StepPlan(self.step_id, chunks)

    def push(self, rows: list[int], new_tokens: tuple[int, ...]) -> None:
        for i, t in zip(rows, new_tokens, strict=True):
            self.tokens[i].append(t)


def padded_step(runner: ModelRunner, plan: StepPlan, batch: int, context: int) -> StepTensors:
    """Eager step tensors of the plan at exactly a bucket's shapes, from step inputs of their
    own (not the graph runner's buffers): explicit scratch rows (slot 0, page 0) up to `batch`
    and block_tables widened to the bucket's ceil(context / PAGE) pages with scratch page 0
    (the Triton decode kernel's split count comes from that width, and the torch path's dense
    gather spans `context` columns, so the replay and this step must agree on both)."""
    groups = runner.backend.inputs.num_kv_groups
    pad = SeqChunk("pad", (0,), 1, 0, (0,), None, window_tables=((0,),) * (groups - 1))
    plan = StepPlan(plan.step_id, plan.seqs + (pad,) * (batch - len(plan.seqs)))
    step = StepInputs(PAGE, runner.device, groups).build(plan)
    extra_pages = -(-context // PAGE) - step.block_tables.shape[1]

    def widen(tables: torch.Tensor) -> torch.Tensor:
        return F.pad(tables, (0, extra_pages), value=0)

    windows = tuple(replace(w, block_tables=widen(w.block_tables)) for w in step.windows)
    return replace(
        step, max_seq_len=context, block_tables=widen(step.block_tables), windows=windows
    )


@torch.inference_mode()
def eager_padded_hidden(
    runner: ModelRunner, plan: StepPlan, batch: int, context: int
) -> torch.Tensor:
    step = padded_step(runner, plan, batch, context)
    runner.backend.bind(step)
    hidden = runner.model(step.input_ids, runner.backend)
    return hidden[: len(plan.seqs)].clone()


def pool_snapshot(runner: ModelRunner) -> dict[str, torch.Tensor]:
    snap = {k: v.clone() for k, v in runner.pool.states.items()}
    for key, t in _kv_tensors(runner).items():
        snap[key] = t.clone()
    return snap


def load_pool(runner: ModelRunner, snap: dict[str, torch.Tensor]) -> None:
    for k, v in runner.pool.states.items():
        v.copy_(snap[k])
    for key, t in _kv_tensors(runner).items():
        t.copy_(snap[key])


def _kv_tensors(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """Every KV group's K and V: "k", "v" for group 0, "k1", "v1", ... for the others."""
    out = {}
    for g, caches in enumerate(runner.pool.kv_caches):
        if caches is not None:
            suffix = str(g) if g else ""
            out["k" + suffix], out["v" + suffix] = caches
    return out


def live_part(snap: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Everything but the scratch slot / scratch page (pad rows may write there)."""
    out = {k: v[:, 1:] for k, v in snap.items() if k[0] not in "kv"}
    for k in snap:
        if k[0] in "kv":
            out[k] = snap[k][:, PAGE:]
    return out


@torch.inference_mode()
def eager_hidden(runner: ModelRunner, plan: StepPlan, rows: int) -> torch.Tensor:
    step = runner.backend.begin_step(plan)
    return runner.model(step.input_ids, runner.backend)[:rows].clone()


def garbage_fill(g: GraphRunner, seed: int = 0) -> None:
    """Fill every per-step buffer of the step inputs with in-range garbage (wrong results, no
    crash)."""
    gen = torch.Generator().manual_seed(seed)
    b = g.inputs
    for t in (b.primary, b.primary_host, b.block_tables, b.qsl_host):
        t.copy_(torch.randint(0, 3, t.shape, generator=gen))
    for t in (b.has_initial_state, b.has_initial_state_host):
        t.copy_(torch.randint(0, 2, t.shape, generator=gen).bool())
    b.query_start_loc.copy_(torch.randint(0, 3, b.query_start_loc.shape, generator=gen))


class FailOnce:
    """Test-side fault injection into a GraphRunner: the first `times` calls at `phase` raise,
    then the wrapped method is put back.

    "prepare" wraps the step inputs' refresh (it raises before writing anything);
    "after_replay" wraps the replay (it raises after the whole captured forward ran, so every
    state write happened). `fired` counts the injected failures.
    """

    def __init__(self, g: GraphRunner, phase: str, times: int = 1) -> None:
        if phase not in ("prepare", "after_replay"):
            raise ValueError(f"unknown phase {phase!r}")
        self.fired, self.left, self.phase = 0, times, phase
        # NOTE: the step inputs are the backend's, shared with eager steps and other runners.
        self.owner, self.name = (g.inputs, "refresh") if phase == "prepare" else (g, "_replay")
        self.real = getattr(self.owner, self.name)
        setattr(self.owner, self.name, self)

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self.phase == "prepare":
            self._fail()
            return self.real(*args, **kwargs)
        out = self.real(*args, **kwargs)
        self._fail()
        return out

    def _fail(self) -> None:
        if self.left <= 0:
            return
        self.left -= 1
        self.fired += 1
        if self.left == 0:
            setattr(self.owner, self.name, self.real)
        raise RuntimeError(f"injected failure at {self.phase}")
