"""Engines for the vision models' tests: `run_together` queues requests at once (parity),
`KeptStateEngine` runs them one by one on 8-token pages with a checkpoint every page (kept
state); both record the plans and check the encoder cache ends empty."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from oracle import OracleRun, assert_matches_oracle

from shortconv import SamplingParams
from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.plan import StepPlan
from shortconv.llm import build_engine


def run_together(
    path: Path,
    feed: list[tuple[list[int], list]],
    params: SamplingParams,
    budget: int = 512,
    plans: list | None = None,
    **engine: object,
) -> list[list[int]]:
    """Our greedy tokens for (ids, images) requests, all queued at once, without prefix caching;
    with `enable_graphs`, every decode step must replay a captured bucket."""
    config = EngineConfig(max_num_batched_tokens=budget, enable_prefix_caching=False, **engine)
    eng = build_engine(path, dtype="float32", engine_config=config)
    if plans is not None:
        execute = eng.executor.execute
        eng.executor.execute = lambda plan: (plans.append(plan), execute(plan))[1]
    rids = [eng.add_request(ids, params, images=images) for ids, images in feed]
    done = {}
    while eng.has_unfinished():
        done |= {o.request_id: o.token_ids for o in eng.step() if o.finished}
    assert eng.executor.runner.images.entries == {}, "the encoder cache must end empty"
    if engine.get("enable_graphs"):
        stats = eng.graph_stats()
        assert stats.replays and not any(stats.eager_fallbacks.values()), stats
    return [done[r] for r in rids]


@dataclass
class Served:
    tokens: list[int]
    cached: int  # prompt tokens resumed from kept state
    encoded: int  # images the encoder ran on for this request


class KeptStateEngine:
    def __init__(self, path: Path, params: SamplingParams, budget: int = 512, **cfg: object):
        config = EngineConfig(
            max_num_batched_tokens=budget, kv_page_size=8, prefix_checkpoint_interval=8, **cfg
        )
        self.params = params
        self.eng: LLMEngine = build_engine(path, dtype="float32", engine_config=config)
        self.plans: list[StepPlan] = []
        execute = self.eng.executor.execute
        self.eng.executor.execute = lambda plan: (self.plans.append(plan), execute(plan))[1]

    def run(self, ids: list[int], images: list, ref: OracleRun, session=None) -> Served:
        """Run one request to the end; it must equal `ref` and leave the encoder cache empty."""
        before = len(self.plans)
        self.eng.add_request(ids, self.params, session_id=session, images=images)
        outs = []
        while self.eng.has_unfinished():
            outs += [o for o in self.eng.step() if o.finished]
        (out,) = outs
        assert self.eng.executor.runner.images.entries == {}, "the encoder cache ends empty"
        assert_matches_oracle(out.token_ids, ref, "kept state")
        encoded = sum(len(p.encoder_inputs) for p in self.plans[before:])
        return Served(out.token_ids, out.num_cached_tokens, encoded)
