"""ZAYA1 padding safety: the CCA reference kernels against F.conv1d and their pad_slot_id
rows, and padded decode batches (pad rows on scratch slot 0 / page 0) at the model level."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.engine.plan import SeqChunk, StepPlan
from shortconv.execution.local_executor import LocalExecutor
from shortconv.execution.worker_spec import Capacity, WorkerSpec
from shortconv.kernels.cca_ref import (
    cca_conv_fn_ref,
    cca_conv_update_ref,
    cca_prev_value_fn_ref,
    cca_prev_value_update_ref,
)
from shortconv.sampling.sampler import SamplingRow
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import build_hf_model

N_SLOTS = 10
HEADS, GROUP = 3, 4  # conv groups (heads) and channels per group
CHANS = HEADS * GROUP


def _weights(t0: int, t1: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(w0 [C, t0], b0 [C], w1 [C, GROUP, t1], b1 [C])."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(CHANS, t0), (CHANS,), (CHANS, GROUP, t1), (CHANS,)]
    return tuple(torch.randn(*sh, generator=g) / (GROUP if len(sh) == 3 else 1) for sh in shapes)


def _meta(lens: list[int], slots: list[int], init: list[bool]) -> tuple[torch.Tensor, ...]:
    """(query_start_loc, cache_indices, has_initial_state) of a packed batch."""
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return qsl, torch.tensor(slots), torch.tensor(init)


def conv_oracle(seq: torch.Tensor, init: torch.Tensor, w0, b0, w1, b1) -> torch.Tensor:
    """The reference's math: [init ‖ seq] then two valid convs (depthwise, grouped), float64."""
    u = torch.cat([init, seq], dim=1).double()[None]
    s1 = F.conv1d(u, w0.double()[:, None, :], b0.double(), groups=CHANS)
    return F.conv1d(s1, w1.double(), b1.double(), groups=HEADS)[0]


@pytest.mark.parametrize("t0,t1", [(1, 1), (1, 3), (3, 1), (2, 2), (3, 3), (2, 3)])
def test_conv_fn_and_update_match_oracle(t0: int, t1: int) -> None:
    k = (t0 - 1) + (t1 - 1)
    w = _weights(t0, t1, seed=t0 * 10 + t1)
    g = torch.Generator().manual_seed(1)
    lens, slots, init = [5, 1, 2, 9], [4, 1, 7, 2], [True, False, True, False]
    states = torch.randn(N_SLOTS, CHANS, k, generator=g)
    before = states.clone()
    seqs = [torch.randn(CHANS, n, generator=g) for n in lens]
    qsl, idx, has_init = _meta(lens, slots, init)
    out = cca_conv_fn_ref(torch.cat(seqs, 1), *w, states, qsl, idx, has_init)
    for b, (seq, slot) in enumerate(zip(seqs, slots, strict=True)):
        start = before[slot] if init[b] else torch.zeros(CHANS, k)
        ref = conv_oracle(seq, start, *w)
        torch.testing.assert_close(out[:, qsl[b] : qsl[b + 1]].double(), ref, atol=1e-5, rtol=1e-5)
        if k:
            torch.testing.assert_close(states[slot], torch.cat([start, seq], 1)[:, -k:])
    # Decode one more token per row from those states == the oracle over the whole history.
    x = torch.randn(len(slots), CHANS, generator=g)
    mid = states.clone()
    dec = cca_conv_update_ref(x, states, *w, idx)
    for b, slot in enumerate(slots):
        ref = conv_oracle(x[b][:, None], mid[slot], *w)[:, 0]
        torch.testing.assert_close(dec[b].double(), ref, atol=1e-5, rtol=1e-5)


def test_fresh_start_is_left_padding_not_causal_zero_padding() -> None:
    """A fresh first token's intermediate (stage-1) columns carry the stage-1 bias."""
    w0, b0, w1, b1 = w = _weights(2, 2)
    x = torch.randn(CHANS)
    out = cca_conv_fn_ref(x[:, None], *w, torch.zeros(2, CHANS, 2), *_meta([1], [1], [False]))
    # Raw window [0, 0, x]: stage-1 columns are b0 (zeros only) and w0[:, 1] * x + b0.
    s1 = torch.stack([b0, w0[:, 1] * x + b0], dim=1)
    causal = torch.stack([torch.zeros(CHANS), w0[:, 1] * x + b0], dim=1)  # the wrong answer

    def stage2(cols: torch.Tensor) -> torch.Tensor:
        w = w1.view(HEADS, GROUP, GROUP, 2)
        return torch.einsum("goit,git->go", w, cols.view(HEADS, GROUP, 2)).reshape(CHANS) + b1

    torch.testing.assert_close(out[:, 0], stage2(s1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[:, 0], stage2(causal), atol=1e-3)


def test_ref_kernels_skip_pad_slot_rows() -> None:
    w = _weights(3, 2)
    g = torch.Generator().manual_seed(2)
    meta = _meta([3, 2, 4, 1], [5, -1, 2, -1], [True, True, False, True])
    x, v = torch.randn(CHANS, 10, generator=g), torch.randn(10, 6, generator=g)
    conv = torch.randn(N_SLOTS, CHANS, 3, generator=g)
    prev = torch.randn(N_SLOTS, 6, generator=g)
    conv0, prev0 = conv.clone(), prev.clone()
    out = cca_conv_fn_ref(x, *w, conv, *meta)
    pv = cca_prev_value_fn_ref(v, prev, torch.ones(6), *meta)
    # The same batch without the pad rows.
    cols = torch.cat([torch.arange(0, 3), torch.arange(5, 9)])
    conv1, prev1 = conv0.clone(), prev0.clone()
    meta1 = _meta([3, 4], [5, 2], [True, False])
    torch.testing.assert_close(out[:, cols], cca_conv_fn_ref(x[:, cols], *w, conv1, *meta1))
    torch.testing.assert_close(
        pv[cols], cca_prev_value_fn_ref(v[cols], prev1, torch.ones(6), *meta1)
    )
    pad_cols = torch.tensor([3, 4, 9])
    assert not out[:, pad_cols].any() and not pv[pad_cols].any()
    assert torch.equal(conv, conv1) and torch.equal(prev, prev1)
    others = [s for s in range(N_SLOTS) if s not in (5, 2)]
    assert torch.equal(conv[others], conv0[others]) and torch.equal(prev[others], prev0[others])

    # Decode twins: pad rows output zeros and leave every slot alone.
    conv0, prev0 = conv.clone(), prev.clone()
    idx = torch.tensor([-1, 2, -1])
    xd, vd = torch.randn(3, CHANS, generator=g), torch.randn(3, 6, generator=g)
    od = cca_conv_update_ref(xd, conv, *w, idx)
    pd = cca_prev_value_update_ref(vd, prev, idx)
    assert not od[[0, 2]].any() and not pd[[0, 2]].any()
    torch.testing.assert_close(pd[1], prev0[2])
    assert torch.equal(prev[2], vd[1])
    others = [s for s in range(N_SLOTS) if s != 2]
    assert torch.equal(conv[others], conv0[others]) and torch.equal(prev[others], prev0[others])
    # All rows padded: nothing at all changes (not even the scratch slot).
    conv0, prev0 = conv.clone(), prev.clone()
    cca_conv_update_ref(xd, conv, *w, torch.full((3,), -1))
    cca_prev_value_update_ref(vd, prev, torch.full((3,), -1))
    assert torch.equal(conv, conv0) and torch.equal(prev, prev0)


def test_prev_value_first_token_rules() -> None:
    """Row t sees v[t-1]; a chunk's first token sees the slot (resumed) or init (fresh)."""
    v = torch.arange(1.0, 8.0)[:, None].repeat(1, 2)  # rows 1..7
    prev = torch.full((4, 2), -5.0)
    prev[3] = 9.0
    out = cca_prev_value_fn_ref(
        v, prev, torch.full((2,), 0.5), *_meta([3, 4], [3, 1], [True, False])
    )
    assert out[:, 0].tolist() == [9.0, 1.0, 2.0, 0.5, 4.0, 5.0, 6.0]
    assert prev[3].tolist() == [3.0, 3.0] and prev[1].tolist() == [7.0, 7.0]


# ---- padded decode batches through the model ------------------------------------------------
PAGE, NUM_PAGES, NUM_SLOTS, BUCKET, N_LIVE = 4, 64, 14, 8, 4
ROW = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)
LIVE_SLOTS, BYSTANDER_SLOTS = (2, 5, 7, 11), (3, 9)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("zaya_pad")
    overrides = {"attention_bias": True, "cca_time0": 3, "cca_time1": 2}
    build_hf_model("zaya1", overrides, seed=5).save_pretrained(str(path))
    eng = EngineConfig(
        max_num_seqs=BUCKET,
        kv_page_size=PAGE,
        num_kv_pages=NUM_PAGES,
        num_state_slots=NUM_SLOTS,
        enable_graphs=False,
    )
    cfg = ModelConfig.from_dir(path)
    cap, cpu = Capacity(NUM_SLOTS, NUM_PAGES), torch.device("cpu")
    spec = WorkerSpec(path, cfg, eng, cap, torch.float32, cpu, cfg.max_model_len)
    return LocalExecutor(spec).runner


def _run(runner, seqs: list[SeqChunk]) -> torch.Tensor:
    with torch.inference_mode():
        step = runner.backend.begin_step(StepPlan(0, tuple(seqs)))
        hidden = runner.model(step.input_ids, runner.backend)
        return runner.model.compute_logits(hidden[step.logits_indices])


def _snap(runner) -> dict[str, torch.Tensor]:
    pool = runner.pool
    return {
        **{n: t.clone() for n, t in pool.states.items()},
        "k": pool.k_cache.clone(),
        "v": pool.v_cache.clone(),
    }


def _restore(runner, snap: dict[str, torch.Tensor]) -> None:
    pool = runner.pool
    for n, t in pool.states.items():
        t.copy_(snap[n])
    pool.k_cache.copy_(snap["k"])
    pool.v_cache.copy_(snap["v"])


def _pages(i: int, n_pos: int) -> tuple[int, ...]:
    return tuple(range(1 + 8 * i, 1 + 8 * i + -(-n_pos // PAGE)))


@pytest.fixture(scope="module")
def prefilled(runner):
    """Live requests and bystanders prefilled in one packed step; returns (requests, snapshot)."""
    rng = random.Random(0)
    slots = LIVE_SLOTS + BYSTANDER_SLOTS
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 14, 6, 5, 11)]
    chunks = [
        SeqChunk(f"r{i}", tuple(p), 0, s, _pages(i, len(p)), ROW)
        for i, (p, s) in enumerate(zip(prompts, slots, strict=True))
    ]
    first = _run(runner, chunks).argmax(-1).tolist()
    reqs = [(f"r{i}", slots[i], [*prompts[i], first[i]]) for i in range(N_LIVE)]
    return reqs, _snap(runner)


def _decode_chunk(i: int, rid: str, slot: int, toks: list[int]) -> SeqChunk:
    pos = len(toks) - 1
    return SeqChunk(rid, (toks[-1],), pos, slot, _pages(i, pos + 1), ROW)


def _pad(j: int) -> SeqChunk:
    return SeqChunk(f"pad{j}", (17 + j,), 1, 0, (0,), None)  # scratch slot 0, page 0


def _check_untouched(after, base, live_slots, live_pages) -> None:
    for name in after:
        if name in ("k", "v"):
            keep = torch.ones(NUM_PAGES, dtype=torch.bool)
            keep[[0, *live_pages]] = False
            layers = after[name].shape[0]
            a = after[name].view(layers, NUM_PAGES, PAGE, -1)
            b = base[name].view(layers, NUM_PAGES, PAGE, -1)
            assert torch.equal(a[:, keep], b[:, keep]), f"{name}: a non-live KV page changed"
        else:
            others = [s for s in range(1, NUM_SLOTS) if s not in live_slots]
            assert torch.equal(after[name][:, others], base[name][:, others]), (
                f"{name}: a slot that is neither live nor scratch changed"
            )


@pytest.mark.parametrize("batch", range(1, N_LIVE + 1))
def test_padded_decode_equals_unpadded(runner, prefilled, batch: int) -> None:
    reqs, base = prefilled
    live = [_decode_chunk(i, rid, slot, toks) for i, (rid, slot, toks) in enumerate(reqs[:batch])]
    live_slots = [c.slot for c in live]
    live_pages = [p for c in live for p in c.block_table]

    _restore(runner, base)
    unpadded = _run(runner, live)
    after_u = _snap(runner)
    _check_untouched(after_u, base, live_slots, live_pages)

    _restore(runner, base)
    half = batch // 2
    pads = [_pad(j) for j in range(BUCKET - batch)]
    padded = _run(runner, [*live[:half], pads[0], *live[half:], *pads[1:]])
    after_p = _snap(runner)
    # (a) live logits and tokens unchanged by the padding.
    torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)
    assert padded.argmax(-1).tolist() == unpadded.argmax(-1).tolist()
    # (b) no state but the live rows' own (and scratch) changed; live state as unpadded.
    _check_untouched(after_p, base, live_slots, live_pages)
    for name in after_p:
        a, u = after_p[name], after_u[name]
        if name in ("k", "v"):
            a, u = (t.view(t.shape[0], NUM_PAGES, PAGE, -1)[:, live_pages] for t in (a, u))
        else:
            a, u = a[:, live_slots], u[:, live_slots]
        torch.testing.assert_close(a, u, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # (c) every row of a batch equals that request decoded alone.
    for i, c in enumerate(live):
        _restore(runner, base)
        torch.testing.assert_close(_run(runner, [c])[0], unpadded[i], rtol=1e-5, atol=1e-5)


def test_padded_decode_chain_keeps_tokens(runner, prefilled) -> None:
    """Several consecutive padded steps produce the unpadded greedy tokens."""
    reqs, base = prefilled
    results = []
    for pad in (False, True):
        _restore(runner, base)
        toks = [list(t) for _, _, t in reqs]
        for _ in range(4):
            live = [_decode_chunk(i, rid, slot, toks[i]) for i, (rid, slot, _) in enumerate(reqs)]
            seqs = live + ([_pad(j) for j in range(BUCKET - len(live))] if pad else [])
            for i, tok in enumerate(_run(runner, seqs).argmax(-1).tolist()):
                toks[i].append(tok)
        results.append(toks)
    assert results[0] == results[1]
