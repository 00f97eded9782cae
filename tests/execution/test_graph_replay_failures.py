"""A replay that fails falls back to eager for that step, is counted, and never corrupts state.

Three failure points: before the refresh ("prepare": nothing ran), in the middle of the
captured forward (a layer raises after earlier layers shifted their conv state in place), and
after the whole replay ran ("after_replay": every state write happened). In each case the step's
result and the whole pool must equal a plain eager step from the same state, bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch
from graph_helpers import (
    NUM_SEQS,
    PAGE,
    FailOnce,
    Seqs,
    eager_hidden,
    graph_runner,
    live_part,
    load_pool,
    make_runner,
    pool_snapshot,
    window_groups,
    zaya_skip_reason,
)

from shortconv.execution.parallel import SINGLE
from shortconv.layers.experts import FusedExperts
from shortconv.tiny.checkpoint import make_tiny_checkpoint

ROWS = [6, 1, 4]


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe", "lfm3", "zaya1"])
def prefilled(request, tmp_path_factory):
    if request.param == "zaya1" and (reason := zaya_skip_reason()):
        pytest.skip(reason)
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=4)
    runner = make_runner(path, enable_graphs=False)
    rng = random.Random(2)
    seqs = Seqs(
        [[rng.randrange(1, 512) for _ in range(3 + 4 * i)] for i in range(NUM_SEQS)],
        window_groups(runner),
    )
    seqs.push(list(range(NUM_SEQS)), runner.execute(seqs.prefill()).token_ids)
    return runner, seqs, pool_snapshot(runner)


class OneShot:
    """Raises once in the middle of the forward: the third layer's pre-hook."""

    def __init__(self, g) -> None:
        self.fired = 0
        self.handle = g.model.layers[2].register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        if not self.fired:
            self.fired += 1
            raise RuntimeError("injected failure at mid_forward")


def _arm(g, phase: str):
    """Inject the failure from test code: layers 0 and 1 have updated their state in place
    when the mid-forward one fires; the others wrap the runner (`graph_helpers.FailOnce`)."""
    return OneShot(g) if phase == "mid_forward" else FailOnce(g, phase)


@pytest.mark.parametrize("phase", ["prepare", "mid_forward", "after_replay"])
def test_failed_replay_equals_eager_and_restores_state(prefilled, phase):
    runner, seqs, snap0 = prefilled
    plan = seqs.decode(ROWS)
    load_pool(runner, snap0)
    ref = eager_hidden(runner, plan, len(ROWS))
    ref_pool = pool_snapshot(runner)

    g = graph_runner(runner, (4,))
    load_pool(runner, snap0)
    shot = _arm(g, phase)
    out = g.run(plan)
    assert shot.fired == 1 and not out.used_graph
    assert torch.equal(out.hidden, ref)
    for k, v in live_part(pool_snapshot(runner)).items():
        assert torch.equal(v, live_part(ref_pool)[k]), k
    stats = g.stats()
    expected_phase = "prepare" if phase == "prepare" else "replay"
    assert stats.replay_failures[expected_phase] == 1 and sum(stats.replay_failures.values()) == 1
    assert stats.eager_fallbacks == {"no_bucket": 0, "mixed_width": 0, "replay_error": 1}
    assert stats.replays == 0

    load_pool(runner, snap0)  # the next step replays normally
    assert g.run(plan).used_graph and g.stats().replays == 1
    if hasattr(shot, "handle"):
        shot.handle.remove()


def test_without_restore_the_failure_would_corrupt_state(prefilled):
    """Control: the restore is what keeps the pool exact (the conv update is in place)."""
    runner, seqs, snap0 = prefilled
    plan = seqs.decode(ROWS)
    load_pool(runner, snap0)
    eager_hidden(runner, plan, len(ROWS))
    ref_pool = pool_snapshot(runner)
    g = graph_runner(runner, (4,))
    g._restore = lambda snapshot: None
    load_pool(runner, snap0)
    _arm(g, "after_replay")
    g.run(plan)
    after = pool_snapshot(runner)
    assert not torch.equal(after["conv"], ref_pool["conv"])


def test_tp_ranks_reraise_after_restoring(prefilled):
    runner, seqs, snap0 = prefilled
    g = graph_runner(runner, (4,))
    g.tp_size = 2  # a one-rank fallback would desynchronise collectives
    load_pool(runner, snap0)
    _arm(g, "after_replay")
    plan = seqs.decode(ROWS)
    with pytest.raises(RuntimeError, match="injected"):
        g.run(plan)
    after = live_part(pool_snapshot(runner))
    for k in runner.pool.states:
        assert torch.equal(after[k], live_part(snap0)[k]), k
    # KV differs only at the step's own new positions, which any retry rewrites before reading.
    new_rows = [s.block_table[s.start_pos // PAGE] * PAGE + s.start_pos % PAGE for s in plan.seqs]
    for k in ("k", "v"):
        changed = (after[k] != live_part(snap0)[k]).flatten(2).any(-1).any(0).nonzero()
        assert set((changed[:, 0] + PAGE).tolist()) <= set(new_rows), k


def test_dense_experts_match_grouped():
    torch.manual_seed(0)
    e, h, i, t, k = 6, 32, 24, 9, 2
    moe = FusedExperts(e, h, i, SINGLE)
    with torch.no_grad():
        moe.gate_up_proj.normal_(0, h**-0.5)
        moe.down_proj.normal_(0, i**-0.5)
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e + 1)[:k] for _ in range(t)])  # includes skip id = e
    w = torch.rand(t, k)
    w[0, 0] = 0.0
    with torch.inference_mode():
        grouped = moe(x, ids, w)
        moe.capture_safe = True
        dense = moe(x, ids, w)
    torch.testing.assert_close(dense, grouped, rtol=1e-5, atol=1e-6)
