"""The step message: over randomized schedules of the real scheduler, every rank's persistent
batch rebuilds exactly the plan the driver made, at every step.

The schedules mix chunked prefill, decodes, preemption (a small page pool), aborts, forks
(n > 1), n-gram verify rows whose rejected proposals swap slot ids, prefix-cache hits and
session resumes, a sliding-window KV group releasing pages, penalty history, grammar masks and
rows' LoRA adapter slots.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
from typing import Any

import pytest

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.window_pages import WindowGroup
from shortconv.configs.speculative import SpeculativeConfig
from shortconv.engine.delta_encoder import StepDeltaEncoder
from shortconv.engine.plan import SeqChunk, StepPlan, StepResult
from shortconv.engine.request import Request
from shortconv.engine.scheduler import Scheduler, SchedulerConfig
from shortconv.execution.persistent_batch import PersistentBatch
from shortconv.sampling.sampling_params import SamplingParams

PAGE = 4


def canon(obj: Any) -> Any:
    """Every field of nested dataclasses, those excluded from `==` included (a sampling row's
    penalty history and grammar mask compare False)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__, *(canon(getattr(obj, f.name)) for f in dataclasses.fields(obj)))
    if isinstance(obj, tuple | list):
        return tuple(canon(x) for x in obj)
    return obj


def params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(4)
    n = 2 if kind == 0 else 1
    penalties: dict[str, Any] = {}
    if kind == 1:
        penalties = {"repetition_penalty": 1.2, "frequency_penalty": 0.5}
    if kind == 2:
        penalties = {"min_tokens": 3, "stop_token_ids": [3]}
    return SamplingParams(
        temperature=0.0, max_tokens=rng.randrange(3, 14), ignore_eos=True, n=n, **penalties
    )


def prompt(rng: random.Random) -> list[int]:
    """Repetitive prompts, so n-gram lookup proposes."""
    motif = [rng.randrange(5, 40) for _ in range(rng.randrange(2, 5))]
    return (motif * 12)[: rng.randrange(3, 40)]


def drawn(plan: StepPlan, rng: random.Random) -> StepResult:
    """Fake samples: a verify row's proposals are accepted up to a random point."""
    ids: list[str] = []
    toks: list[int] = []
    for chunk in plan.seqs:
        cut = rng.randrange(chunk.num_draft + 1)
        for i, (rid, _) in enumerate(chunk.samples):
            ids.append(rid)
            match = chunk.num_draft and i < cut
            toks.append(chunk.token_ids[i + 1] if match else rng.randrange(5, 40))
    n = len(ids)
    return StepResult(plan.step_id, tuple(ids), tuple(toks), (None,) * n, (None,) * n)


def with_masks(plan: StepPlan, rng: random.Random) -> StepPlan:
    """Grammar masks on some rows, as the scheduler's grammar runtime gives them."""

    def masked(chunk: SeqChunk) -> SeqChunk:
        if chunk.sampling is None or rng.random() < 0.7:
            return chunk
        mask = rng.randbytes(8)
        return dataclasses.replace(
            chunk, sampling=dataclasses.replace(chunk.sampling, token_mask=mask)
        )

    return dataclasses.replace(plan, seqs=tuple(masked(c) for c in plan.seqs))


def scheduler(rng: random.Random) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=rng.choice([8, 16, 24]),
        max_model_len=128,
        page_size=PAGE,
        eos_token_ids=(2,),
        enable_prefix_caching=True,
        checkpoint_interval=PAGE * 2,
        speculative=SpeculativeConfig(num_speculative_tokens=3),
    )
    window = WindowGroup(8, PageAllocator(1 + 24))
    return Scheduler(cfg, SlotAllocator(14), PageAllocator(1 + 24), (window,))


class Seen:
    """Counts of the delta kinds a schedule exercised (a schedule that missed one proves less)."""

    def __init__(self) -> None:
        self.kinds: set[str] = set()

    def note(self, prev: dict[str, SeqChunk], plan: StepPlan) -> None:
        for c in plan.seqs:
            old = prev.get(c.request_id)
            if old is not None and c.slot != old.slot and c.start_pos > 0:
                self.kinds.add("slot swap")
            if old is not None and len(c.block_table) > len(old.block_table):
                self.kinds.add("appended pages")
            if any(0 in t for t in c.window_tables):
                self.kinds.add("window release")
            self.kinds.update(
                k
                for k, on in (
                    ("verify", c.num_draft),
                    ("fork", c.fork_rows),
                    ("checkpoint", c.checkpoints),
                    ("mask", c.sampling is not None and c.sampling.token_mask),
                    ("history", c.sampling is not None and c.sampling.output_token_ids),
                    ("lora", c.lora_slot >= 0),
                )
                if on
            )
        if plan.copies_before:
            self.kinds.add("prefix hit")


def run_schedule(seed: int, encoder: StepDeltaEncoder, seen: Seen) -> None:
    rng = random.Random(seed)
    s, ranks = scheduler(rng), [PersistentBatch(), PersistentBatch()]
    prev: dict[str, SeqChunk] = {}
    made: list[Request] = []
    next_id = 0
    for _ in range(120):
        if rng.random() < 0.3:
            session = f"s{rng.randrange(3)}" if rng.random() < 0.3 else None
            req = Request(f"r{next_id}", prompt(rng), params(rng), seed=rng.randrange(1 << 40))
            req.session_id = session
            req.lora_slot = rng.choice([-1, -1, 0, 1, 2])  # as EngineLoras.bind sets it
            s.add(req)
            made.append(req)
            next_id += 1
        if s.requests and rng.random() < 0.08:
            s.abort(rng.choice(sorted(s.requests)))
        plan = s.schedule()
        if plan is None:
            continue
        plan = with_masks(plan, rng)
        delta = pickle.loads(pickle.dumps(encoder.encode(plan), protocol=5))
        for rank in ranks:
            rebuilt = rank.apply(delta)
            assert canon(dataclasses.replace(rebuilt, released=())) == canon(
                dataclasses.replace(plan, released=())
            ), f"step {plan.step_id}"
            assert rank.request_ids() == set(encoder.rows)
            assert not set(plan.released) & rank.request_ids() - {c.request_id for c in plan.seqs}
        assert set(encoder.rows) <= set(s.requests)  # what left was dropped
        seen.note(prev, plan)
        if any(r.num_preemptions for r in made):
            seen.kinds.add("preemption")
        prev.update({c.request_id: c for c in plan.seqs})
        s.update(plan, drawn(plan, rng))


def test_every_rank_rebuilds_the_drivers_plan_at_every_step() -> None:
    seen = Seen()
    for seed in range(12):
        run_schedule(seed, StepDeltaEncoder(), seen)
    assert seen.kinds >= {
        "slot swap",
        "appended pages",
        "window release",
        "verify",
        "fork",
        "checkpoint",
        "mask",
        "history",
        "prefix hit",
        "preemption",
        "lora",
    }, seen.kinds


def test_a_malformed_message_is_refused() -> None:
    encoder, batch = StepDeltaEncoder(), PersistentBatch()
    row = SeqChunk("a", (5, 6), 0, 1, (3,), None)
    delta = encoder.encode(StepPlan(1, (row,)))
    with pytest.raises(ValueError, match="malformed"):
        batch.apply(dataclasses.replace(delta, ints=delta.ints + bytes(8)))
