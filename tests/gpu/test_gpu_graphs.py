"""CUDA-graph decode: replays equal eager decode, padding never touches live state, and a failed
replay is restored and recomputed. Random weights at small real-ish widths (no checkpoint).

Fixture-free on purpose: bench/gpu_check.sh can run these functions without pytest. The checks
take the device and configs as arguments, so tests/execution/test_gpu_graphs_cpu.py
runs the same code on
CPU at tiny widths (there a "replay" is the captured forward run eagerly on the static buffers).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from graph_helpers import (
    NUM_SEQS,
    PAGES_PER_SEQ,
    FailOnce,
    Seqs,
    eager_hidden,
    eager_padded_hidden,
    engine_config,
    garbage_fill,
    live_part,
    load_pool,
    pool_snapshot,
    zaya_skip_reason,
)

from shortconv.execution.graph_runner import GraphRunner
from shortconv.kernels.dispatch import resolve_backend
from shortconv.tiny.random_stack import RandomStack, build_random_stack

pytestmark = pytest.mark.gpu

_COMMON: dict[str, Any] = {"vocab_size": 4096, "max_position_embeddings": 4096}
CONFIGS: dict[str, dict[str, Any]] = {
    "lfm2": {
        **_COMMON,
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "hidden_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "conv_L_cache": 3,
        "block_ff_dim": 2048,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
    },
    "lfm2_moe": {
        **_COMMON,
        "architectures": ["Lfm2MoeForCausalLM"],
        "model_type": "lfm2_moe",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "conv_L_cache": 3,
        "intermediate_size": 1024,
        "moe_intermediate_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_dense_layers": 1,
        "use_expert_bias": True,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    "zaya1": {
        **_COMMON,
        "architectures": ["ZayaForCausalLM"],
        "model_type": "zaya",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 256,
        "router_hidden_size": 64,
        "cca_time0": 2,
        "cca_time1": 2,
    },
}
PROMPT_LENS = (3, 14, 9, 30, 5, 17, 40, 12)


Configs = dict[str, dict[str, Any]]


def _archs(configs: Configs) -> list[str]:
    return [a for a in configs if a != "zaya1" or zaya_skip_reason() is None]


def _prefilled(
    raw: dict[str, Any], device: str
) -> tuple[RandomStack, Seqs, dict[str, torch.Tensor]]:
    eng = engine_config()
    stack = build_random_stack(
        raw,
        device,
        torch.float32,
        eng,
        num_slots=NUM_SEQS + 2,
        num_pages=1 + NUM_SEQS * PAGES_PER_SEQ,
        seed=1,
    )
    rng = random.Random(0)
    seqs = Seqs([[rng.randrange(1, raw["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS])
    with torch.inference_mode():
        step = stack.backend.begin_step(seqs.prefill())
        hidden = stack.model(step.input_ids, stack.backend)
        first = stack.model.compute_logits(hidden[step.logits_indices]).argmax(-1)
    seqs.push(list(range(NUM_SEQS)), tuple(first.tolist()))
    return stack, seqs, pool_snapshot(stack)


def _graphs(stack: RandomStack, batch_sizes: tuple[int, ...]) -> GraphRunner:
    eng = engine_config(graph_batch_sizes=batch_sizes, max_num_seqs=max(batch_sizes))
    g = GraphRunner(stack.model, stack.backend, eng, stack.cfg.max_model_len)
    g.capture()
    assert g.use_cuda_graphs == (stack.device.type == "cuda")
    if resolve_backend(stack.device) == "triton":  # the paged kernels: one context bucket
        assert g.context_sizes == (stack.cfg.max_model_len,), g.context_sizes
    return g


@torch.inference_mode()  # like the engine: hidden states from eager_hidden are inference tensors
def _assert_same_greedy(stack: RandomStack, a: torch.Tensor, b: torch.Tensor) -> None:
    la, lb = stack.model.compute_logits(a), stack.model.compute_logits(b)
    top2 = torch.topk(lb, 2, dim=-1).values
    differ = la.argmax(-1) != lb.argmax(-1)
    assert bool((top2[differ, 0] - top2[differ, 1] < 1e-3).all()), "greedy token changed"


def check_decode_matches_eager(device: str, configs: Configs = CONFIGS) -> None:
    """Every bucket and fill level: replay = padded eager (tight), = unpadded eager (loose, same
    greedy), and padding rows write only the scratch slot."""
    for arch in _archs(configs):
        stack, seqs, snap0 = _prefilled(configs[arch], device)
        for bucket in (1, 2, 4, 8):
            g = _graphs(stack, (bucket,))
            garbage_fill(g, seed=bucket)  # the first replay must not read capture leftovers
            for n in range(1, bucket + 1):
                rows = random.Random(bucket * 100 + n).sample(range(NUM_SEQS), n)
                plan = seqs.decode(rows)
                context = g.shape_for(plan).context
                load_pool(stack, snap0)
                out = g.run(plan)
                assert out.used_graph, (arch, bucket, n)
                replayed, after = out.hidden.clone(), pool_snapshot(stack)
                load_pool(stack, snap0)
                with g.static_shapes():
                    ref = eager_padded_hidden(stack, plan, bucket, context)
                torch.testing.assert_close(replayed, ref, rtol=1e-5, atol=1e-5)
                ref_pool = live_part(pool_snapshot(stack))
                for k, v in live_part(after).items():
                    torch.testing.assert_close(v, ref_pool[k], rtol=1e-5, atol=1e-5)
                load_pool(stack, snap0)
                eager = eager_hidden(stack, plan, n)
                torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
                _assert_same_greedy(stack, replayed, eager)
                touched = {s.slot for s in plan.seqs}
                others = [s for s in range(1, NUM_SEQS + 2) if s not in touched]
                for k in stack.pool.states:  # padding wrote only the scratch slot
                    assert torch.equal(after[k][:, others], snap0[k][:, others]), (arch, k)
            assert g.stats().replays == bucket


def check_failure_restores(device: str, configs: Configs = CONFIGS) -> None:
    """A replay that fails after running restores the step's state and recomputes eagerly."""
    for arch in _archs(configs):
        stack, seqs, snap0 = _prefilled(configs[arch], device)
        plan = seqs.decode([6, 1, 4])
        load_pool(stack, snap0)
        ref = eager_hidden(stack, plan, 3)
        ref_pool = live_part(pool_snapshot(stack))
        g = _graphs(stack, (4,))
        load_pool(stack, snap0)
        shot = FailOnce(g, "after_replay")
        out = g.run(plan)
        assert shot.fired == 1 and not out.used_graph
        assert torch.equal(out.hidden, ref), arch
        for k, v in live_part(pool_snapshot(stack)).items():
            assert torch.equal(v, ref_pool[k]), (arch, k)
        assert g.stats().replay_failures["replay"] == 1
        load_pool(stack, snap0)
        assert g.run(plan).used_graph


def test_cuda_graph_decode_matches_eager_every_bucket_and_padding():
    check_decode_matches_eager("cuda")


def test_cuda_graph_failure_restores_state_and_recomputes():
    check_failure_restores("cuda")
