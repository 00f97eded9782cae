"""Graph-captured decode on CPU: the static-buffer, padding and refresh protocol.

On CPU a "replay" runs the captured forward eagerly on the static buffers, so these tests pin
the protocol the CUDA graphs rely on (tests/gpu/ repeats the key ones with real graphs).

Exactness. A replay pads the batch to its bucket and the context to its context bucket. Live
rows are then bit-identical to an eager forward of the same plan padded with explicit scratch
rows to the same shapes (same kernels, same shapes). They are NOT bit-identical to the unpadded
eager step: CPU BLAS picks different blockings for different row counts M, so a row of
x @ W^T can change in the last bits with M (measured: ~1e-6 for M=3 vs 4). Against the
unpadded step we therefore check live rows to a tight tolerance, greedy tokens exactly, and
every slot outside the step bit-for-bit untouched.

Kernels. The replay-equals-eager checks run twice: on the default CPU torch paths and with
`SHORTCONV_KERNELS=triton` under the interpreter (the paged attention kernels read the static
block tables; torch SDPA is forbidden), for LFM2's attention and ZAYA1's CCA. LFM2-MoE has
LFM2's attention layer; its MoE kernel is covered where it lives.
"""

from __future__ import annotations

import importlib.util
import logging
import random

import pytest
import torch
from graph_helpers import (
    CONTEXTS,
    NUM_SEQS,
    Seqs,
    eager_hidden,
    eager_padded_hidden,
    garbage_fill,
    graph_runner,
    live_part,
    load_pool,
    make_runner,
    pool_snapshot,
    window_groups,
    zaya_skip_reason,
)
from triton_path import force_triton_path, rebind_kernels

from shortconv.errors import ConfigError
from shortconv.execution.backend import ShortConvBackend
from shortconv.execution.graph_runner import batch_buckets, context_buckets
from shortconv.kernels import attention_dense
from shortconv.kernels.dispatch import attention_context_buckets, resolve_backend
from shortconv.tiny.checkpoint import make_tiny_checkpoint

ARCHS = ["lfm2", "lfm2_moe", "lfm3", "zaya1"]
# Prompt lengths: contexts land in all three context buckets (16, 32, 64) after prefill.
PROMPT_LENS = (3, 14, 9, 30, 5, 17, 40, 12)
# The fewest layers that keep every layer kind of an architecture: the protocol is per layer
# kind, and each layer costs the interpreted Triton variants ~4 s per test.
FEWER_LAYERS = {
    "lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},
    "lfm3": {
        "num_hidden_layers": 3,
        "layer_types": ["conv", "sliding_attention", "full_attention"],
    },
    "zaya1": {"num_hidden_layers": 2},
}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=ARCHS)
def prefilled(request, tmp_path_factory):
    """(runner, seqs, pool snapshot after a prefill of all NUM_SEQS prompts)."""
    arch = request.param
    if arch == "zaya1" and (reason := zaya_skip_reason()):
        pytest.skip(reason)
    path = make_tiny_checkpoint(
        arch, tmp_path_factory.mktemp(arch), FEWER_LAYERS.get(arch), seed=11
    )
    runner = make_runner(path)
    seqs = Seqs(_prompts(5), window_groups(runner))
    result = runner.execute(seqs.prefill())
    seqs.push(list(range(NUM_SEQS)), result.token_ids)
    runner.test_model_dir = path  # for a second runner over the same checkpoint
    return runner, seqs, pool_snapshot(runner)


def _use_kernels(kernels: str, runner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the test on `kernels`: "torch" (the default CPU paths) or "triton" (interpreted).

    For "triton" the runner gets a fresh backend (step inputs of its own) with
    SHORTCONV_KERNELS=triton set and its layers' kernels bound again, as a runner built there
    would have; the pool is the same, and monkeypatch restores the module fixture's backend
    and kernels afterwards."""
    if kernels == "torch":
        return
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if runner.cfg.arch == "lfm2_moe":
        pytest.skip("LFM2-MoE's attention is LFM2's (checked there); time kept for the others")
    # Sets SHORTCONV_KERNELS=triton and the interpreter, and forbids torch SDPA and the torch
    # path's [B, L] gather: a layer left on its build-time torch kernels fails the test.
    force_triton_path(monkeypatch)
    old = runner.backend
    monkeypatch.setattr(runner, "backend", ShortConvBackend(old.pool, old.device, old.extra_state))
    rebind_kernels(runner.model, old.device, monkeypatch)
    assert resolve_backend(old.device) == "triton"


def _rows_for(n: int, bucket: int) -> list[int]:
    # A different subset per (bucket, n), so slots, contexts and row order all vary.
    rows = list(range(NUM_SEQS))
    random.Random(bucket * 100 + n).shuffle(rows)
    return rows[:n]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_every_bucket_and_padding_amount(prefilled, kernels, monkeypatch):
    runner, seqs, snap0 = prefilled
    _use_kernels(kernels, runner, monkeypatch)
    for bucket in (1, 2, 4, 8):
        g = graph_runner(runner, (bucket,))
        garbage_fill(g, seed=bucket)  # the first replay after capture must not see this
        for n in range(1, bucket + 1):
            rows = _rows_for(n, bucket)
            plan = seqs.decode(rows)
            shape = g.shape_for(plan)
            assert shape is not None and shape.batch == bucket
            load_pool(runner, snap0)
            out = g.run(plan)
            assert out.used_graph
            replayed, after_replay = out.hidden.clone(), pool_snapshot(runner)

            load_pool(runner, snap0)  # same shapes, fresh eager tensors, same code path
            with g.static_shapes():
                ref = eager_padded_hidden(runner, plan, bucket, shape.context)
            assert torch.equal(replayed, ref), (bucket, n)
            for k, v in live_part(pool_snapshot(runner)).items():
                assert torch.equal(live_part(after_replay)[k], v), (bucket, n, k)

            # The unpadded eager step (grouped MoE, M = n), a tolerance check: on the
            # interpreted Triton kernels it would add half again to the time, for no check
            # that the bit-exact comparison above and the kernel tests do not make already.
            if kernels == "torch":
                load_pool(runner, snap0)
                eager = eager_hidden(runner, plan, n)
                torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
                logits = runner.model.compute_logits(torch.cat([replayed, eager]))
                assert torch.equal(logits[:n].argmax(-1), logits[n:].argmax(-1)), (bucket, n)
            untouched = [s for s in range(1, snap0["conv"].shape[1]) if s not in _slots(plan)]
            for k in runner.pool.states:
                assert torch.equal(after_replay[k][:, untouched], snap0[k][:, untouched])
        stats = g.stats()
        assert stats.replays == bucket and sum(stats.replay_failures.values()) == 0


def _slots(plan) -> set[int]:
    return {s.slot for s in plan.seqs}


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_first_replay_uses_the_plans_indices(prefilled, kernels, monkeypatch):
    """SGLang once replayed with a never-initialised index buffer: garbage the static buffers
    right after capture, and the first replay must still be exact. The control run (refresh
    disabled) proves the garbage would have shown."""
    runner, seqs, snap0 = prefilled
    _use_kernels(kernels, runner, monkeypatch)
    plan = seqs.decode([3, 0, 6])
    load_pool(runner, snap0)
    g = graph_runner(runner, (4,))
    with g.static_shapes():
        ref = eager_padded_hidden(runner, plan, 4, g.shape_for(plan).context)
    for control in (False, True):
        load_pool(runner, snap0)
        g = graph_runner(runner, (4,))
        garbage_fill(g)
        if control:
            monkeypatch.setattr(g.inputs, "refresh", lambda plan, shape: None)
        out = g.run(plan)
        assert out.used_graph and torch.equal(out.hidden, ref) != control


def test_static_buffers_keep_their_addresses(prefilled):
    runner, seqs, snap0 = prefilled
    g = graph_runner(runner, (2, 4, 8))
    shape = g.shapes()[0]
    step = g.inputs.graph_step(shape)
    tensors = (
        step.input_ids,
        step.positions,
        step.cache_indices,
        step.query_start_loc,
        step.slot_mapping,
        step.block_tables,
    )
    ptrs = [t.data_ptr() for t in tensors]
    load_pool(runner, snap0)
    for n in (8, 3, 1, 6):
        g.run(seqs.decode(list(range(n))))
        runner.execute(
            Seqs([[1, 2, 3]], window_groups(runner)).prefill()
        )  # an eager step views the same buffers
    assert g.inputs.graph_step(shape) is step
    assert [t.data_ptr() for t in tensors] == ptrs


def test_no_bucket_fallbacks(prefilled):
    runner, seqs, snap0 = prefilled
    g = graph_runner(runner, (1, 2))
    load_pool(runner, snap0)
    too_many = seqs.decode([0, 1, 2])
    assert g.shape_for(too_many) is None
    out = g.run(too_many)
    assert not out.used_graph and out.hidden.shape[0] == 3
    long_row = PROMPT_LENS.index(40)  # context 41 fits 64; make one past the last bucket
    assert g.shape_for(seqs.decode([long_row])).context == CONTEXTS[-1]
    long_seqs = Seqs([[7] * (CONTEXTS[-1] + 1)], window_groups(runner))
    assert g.shape_for(long_seqs.decode([0])) is None
    stats = g.stats()
    assert stats.eager_fallbacks == {"no_bucket": 1, "mixed_width": 0, "replay_error": 0}
    assert stats.replays == 0


def test_runner_routes_decode_through_graphs(prefilled):
    """ModelRunner.execute: decode plans replay (used_graph), greedy tokens equal a runner
    without graphs over several steps, with contexts crossing a context bucket."""
    runner, seqs, snap0 = prefilled
    eager_runner = make_runner(runner.test_model_dir, enable_graphs=False)
    load_pool(runner, snap0)
    load_pool(eager_runner, snap0)
    before = runner.graphs.stats().replays
    a, b = (
        Seqs([list(t) for t in seqs.tokens], window_groups(runner)),
        Seqs([list(t) for t in seqs.tokens], window_groups(runner)),
    )
    for step in range(6):
        rows = list(range(NUM_SEQS - step))  # the batch shrinks: bucket 8 -> 4 -> 2
        ra, rb = runner.execute(a.decode(rows)), eager_runner.execute(b.decode(rows))
        assert ra.used_graph and not rb.used_graph
        assert ra.token_ids == rb.token_ids, step
        a.push(rows, ra.token_ids)
        b.push(rows, rb.token_ids)
    stats = runner.graphs.stats()
    assert stats.replays - before == 6 and sum(stats.eager_fallbacks.values()) == 0


def test_prefill_never_uses_graphs(prefilled):
    runner, seqs, snap0 = prefilled
    load_pool(runner, snap0)
    result = runner.execute(Seqs([[1, 2, 3]], window_groups(runner)).prefill())
    assert not result.used_graph


def test_bucket_ladders():
    assert batch_buckets((1, 2, 4, 8, 16, 32), 5) == (1, 2, 4, 8)
    assert batch_buckets((4, 1, 2), 32) == (1, 2, 4)
    assert context_buckets((256, 512, 1024), 300) == (256, 300)
    cpu = torch.device("cpu")
    assert attention_context_buckets(cpu, (256, 300), 300) == (256, 300)  # torch: the ladder
    with pytest.raises(ConfigError):
        batch_buckets((), 4)
    with pytest.raises(ConfigError):
        context_buckets((0, 16), 64)


def test_capture_logs_progress(prefilled, caplog):
    runner, _, _ = prefilled
    with caplog.at_level(logging.INFO, logger="shortconv.execution.graph_runner"):
        g = graph_runner(runner, (1, 4))
    n = len(g.shapes())
    assert n == 2 * len(CONTEXTS) and g.stats().num_graphs == n
    assert f"capturing {n} graphs: batch sizes [1, 4] x context sizes" in caplog.text
    assert f"graph 1/{n} (batch 4, context 64, width 1)" in caplog.text
    assert f"graph {n}/{n} (batch 1, context 16, width 1)" in caplog.text
    assert caplog.text.count(", elapsed ") == n
    assert f"{n} graphs ready" in caplog.text


def test_only_the_torch_path_derives_the_dense_layout(prefilled, monkeypatch):
    """No step carries a layout flag: every step (eager decode and prefill, a graph bucket's)
    is the same block tables and seq_lens. The torch attention path derives its dense gather
    and mask from them once per step, however many layers attend; the Triton path never."""
    runner, seqs, snap0 = prefilled
    real, built = attention_dense._build, []
    monkeypatch.setattr(
        attention_dense, "_build", lambda step: built.append(step.num_seqs) or real(step)
    )
    decode, prefill = (
        seqs.decode([4, 0, 7]),
        Seqs([[1, 2, 3], [4] * 9], window_groups(runner)).prefill(),
    )
    for kernels in ("torch", "triton"):
        _use_kernels(kernels, runner, monkeypatch)
        g = graph_runner(runner, (4,))
        for plan, graph in ((decode, True), (decode, False), (prefill, False)):
            load_pool(runner, snap0)
            built.clear()
            if graph:
                assert g.run(plan).used_graph
            else:
                with torch.inference_mode():  # like the runner
                    step = runner.backend.begin_step(plan)
                    runner.model(step.input_ids, runner.backend)
            want = [4 if graph else len(plan.seqs)] if kernels == "torch" else []
            assert built == want, (kernels, graph, plan.is_decode)


def test_triton_captures_one_context_bucket_per_batch_bucket(prefilled, monkeypatch, caplog):
    """The paged kernels mask by seq_lens, so the Triton backend captures one context bucket,
    the engine's max_model_len, per batch bucket (not the graph_context_sizes ladder), and a
    context past the ladder's last bucket still finds a graph."""
    runner, _, _ = prefilled
    _use_kernels("triton", runner, monkeypatch)
    max_len = runner.cfg.max_model_len
    assert max_len > CONTEXTS[-1]
    with caplog.at_level(logging.INFO, logger="shortconv.execution.graph_runner"):
        g = graph_runner(runner, (1, 2, 4, 8))
    assert g.context_sizes == (max_len,)
    assert [(s.batch, s.context) for s in g.shapes()] == [(b, max_len) for b in (8, 4, 2, 1)]
    assert g.stats().num_graphs == 4
    assert "(triton kernels)" in caplog.text
    assert "graph 4/4 (batch 1, context" in caplog.text
    long_seqs = Seqs([[7] * (CONTEXTS[-1] + 1)], window_groups(runner))
    assert g.shape_for(long_seqs.decode([0])) == g.shapes()[-1]
