"""State bundles: the pure format, and a session moved into a fresh engine by export + import.

The oracle for a moved session is the same engine recomputing the whole prompt with no kept
state (itself checked against transformers in tests/models), and the same two turns served by
one engine. A bundle whose conv window is shifted by one token must be caught by that oracle.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import pytest
import torch
from bundle_damage import shifted

from shortconv.cache.state_bundle import (
    FORMAT_VERSION,
    MAGIC,
    BundleCheckpoint,
    BundleError,
    BundleLayout,
    StateBundle,
    decode,
    encode,
)
from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

# With each token's logprob: a tiny model that repeats one token whatever came before would
# let a wrong state through on tokens alone, its logprobs do not.
G = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
LAYOUT = BundleLayout("f" * 32, "torch.float32", 1, 4)


def small_bundle() -> StateBundle:
    tensors = {
        "conv": torch.randn(2, 2, 8, 2),
        "kv0.k": torch.randn(1, 8, 2, 4).to(torch.bfloat16),
        "kv0.v": torch.randn(1, 8, 2, 4).to(torch.bfloat16),
    }
    checkpoints = (BundleCheckpoint(3, (0,), ((0,),)), BundleCheckpoint(5, (0,), ((0, 1),)))
    return StateBundle(LAYOUT, (5, 6, 7, 8, 9), checkpoints, tensors)


def test_round_trip_is_exact():
    b = small_bundle()
    got = decode(encode(b))
    assert got.layout == b.layout and got.token_ids == b.token_ids
    assert got.checkpoints == b.checkpoints and set(got.tensors) == set(b.tensors)
    for name, t in b.tensors.items():
        assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t)


@pytest.mark.parametrize("where", [0, 20, -40, -1])
def test_flipped_byte_is_refused(where):
    data = bytearray(encode(small_bundle()))
    data[where] ^= 0x01
    with pytest.raises(BundleError) as err:
        decode(bytes(data))
    assert err.value.reason == "checksum"


@pytest.mark.parametrize("keep", [0, 10, 100])
def test_truncated_is_refused(keep):
    data = encode(small_bundle())
    with pytest.raises(BundleError) as err:
        decode(data[: min(keep, len(data) - 1)])
    assert err.value.reason in ("truncated", "checksum")


def _resigned(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def test_unknown_version_is_refused():
    body = encode(small_bundle())[:-32]
    body = MAGIC + struct.pack("<I", FORMAT_VERSION + 1) + body[len(MAGIC) + 4 :]
    with pytest.raises(BundleError) as err:
        decode(_resigned(body))
    assert err.value.reason == "version"


def test_not_a_bundle_is_refused():
    with pytest.raises(BundleError) as err:
        decode(_resigned(b"NOTSTATE" + b"\0" * 40))
    assert err.value.reason == "format"


# ---- a session moved between engines ----------------------------------------------------
@pytest.fixture(scope="module", params=["lfm2", "zaya1", "lfm3"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ckpt(arch, tmp_path_factory):
    # NOTE: seeds whose greedy output varies with the state (tiny ZAYA1 often repeats one
    # token whatever came before, which would let a wrong state pass).
    return make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=SEEDS[arch])


def engine(ckpt, **kw) -> LLMEngine:
    # Pages of 4 tokens: LFM3's window (8) spans pages, so a checkpoint keeps window pages.
    cfg = EngineConfig(enable_prefix_caching=False, kv_page_size=4, **kw)
    return build_engine(ckpt, dtype="float32", engine_config=cfg)


@dataclass(frozen=True)
class Turn:
    tokens: list[int]
    logprobs: list[float]

    def same(self, other: Turn) -> bool:
        """Equal greedy tokens, and logprobs equal up to fp32 reduction order."""
        close = all(abs(a - b) < 1e-4 for a, b in zip(self.logprobs, other.logprobs, strict=True))
        return self.tokens == other.tokens and close


def run(eng: LLMEngine, prompt: list[int], session: str | None = None) -> tuple[Turn, int]:
    rid = eng.add_request(prompt, G, session_id=session)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                lps = [float(x) for x in out.logprobs or () if x is not None]
                return Turn(out.token_ids, lps), out.num_cached_tokens


SEEDS = {"lfm2": 11, "zaya1": 5, "lfm3": 11}
P1 = [int(t) for t in torch.randint(4, 500, (23,), generator=torch.Generator().manual_seed(3))]


def first_turn(ckpt) -> tuple[LLMEngine, list[int], bytes]:
    """Engine A serves turn 1 of session "s"; returns A, turn 2's prompt and A's bundle."""
    a = engine(ckpt)
    out1, _ = run(a, P1, "s")
    bundle = a.export_session("s")
    assert bundle is not None
    return a, P1 + out1.tokens + [40, 41, 42], bundle


def held(eng: LLMEngine) -> tuple[int, ...]:
    """Slots and pages (every KV group) in use."""
    cm = eng.scheduler.cache_manager
    return (cm.slots.num_used, *(a.num_used for a in cm.kv.allocators))


def test_moved_session_equals_one_engine_and_recompute(ckpt):
    a, p2, bundle = first_turn(ckpt)
    b = engine(ckpt)
    assert b.import_session("s", bundle)
    moved, cached = run(b, p2, "s")
    assert cached == len(P1) + len(p2) - len(P1) - 4  # everything but the new turn's tail
    assert moved.same(run(a, p2, "s")[0])  # the same two turns on one engine
    assert moved.same(run(engine(ckpt), p2)[0])  # recomputed from scratch
    assert b.session_state.counters.events["imported"] == 1


def test_bundle_carries_every_pinned_checkpoint_with_shared_pages_once(ckpt):
    a, _, bundle = first_turn(ckpt)
    b = decode(bundle)
    deepest = len(P1) + G.max_tokens - 1  # the last sampled token was never fed back
    assert [c.num_tokens for c in b.checkpoints] == [len(P1), deepest]
    assert b.token_ids[: len(P1)] == tuple(P1)
    prompt_end, last = b.checkpoints
    assert prompt_end.pages[0] == last.pages[0][: len(prompt_end.pages[0])]  # stored once
    assert b.tensors["kv0.k"].shape[1] == len(last.pages[0]) * 4
    kinds = {name: t for name, t in b.tensors.items() if not name.startswith("kv")}
    # every state kind travels (ZAYA1: its CCA conv state and its previous-token state)
    assert set(kinds) == set(a.executor.runner.pool.states)
    assert all(t.shape[1] == 2 for t in kinds.values())  # one slot per checkpoint


@pytest.mark.parametrize("keep", [0, 2])
def test_turn_diverging_inside_the_answer_resumes_from_the_moved_prompt_end(ckpt, keep):
    """A chat template that re-renders the answer differently: turn 2 shares only the prompt
    (and `keep` answer tokens) with turn 1, so it can resume only from the prompt's end."""
    a = engine(ckpt)
    out1, _ = run(a, P1, "s")
    p2 = P1 + out1.tokens[:keep] + [40, 41, 42]
    bundle = a.export_session("s")
    assert bundle is not None
    b = engine(ckpt)
    assert b.import_session("s", bundle)
    moved, cached = run(b, p2, "s")
    assert cached == len(P1)
    assert moved.same(run(a, p2, "s")[0])  # the same two turns on one engine
    assert moved.same(run(engine(ckpt), p2)[0])  # recomputed from scratch


def test_oracle_bites_on_a_window_shifted_by_one_token(ckpt):
    """The equality above must fail for a bundle that is off by one token in one conv layer."""
    a, p2, bundle = first_turn(ckpt)
    b = engine(ckpt)
    assert b.import_session("s", shifted(bundle))  # well-formed: only the oracle can tell
    wrong, cached = run(b, p2, "s")
    assert cached > 0
    assert not wrong.same(run(a, p2, "s")[0])


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_checkpoint"])
def test_refused_bundle_reprefills_correctly_and_leaks_nothing(arch, ckpt, damage, tmp_path):
    a, p2, bundle = first_turn(ckpt)
    if damage == "flip":
        data, reason = bytearray(bundle), "checksum"
        data[len(data) // 2] ^= 0x10
        bad = bytes(data)
    elif damage == "truncate":
        bad, reason = bundle[: len(bundle) * 2 // 3], "checksum"
    else:
        other = make_tiny_checkpoint(arch, tmp_path / "other", seed=12)
        c = engine(other)
        run(c, P1, "s")
        exported, reason = c.export_session("s"), "fingerprint"
        assert exported is not None
        bad = exported
    b = engine(ckpt)
    before = held(b)
    assert not b.import_session("s", bad)
    assert held(b) == before and "s" not in b.sessions
    assert b.session_state.counters.refused == {reason: 1}
    out, cached = run(b, p2, "s")
    assert cached == 0
    assert out.same(run(a, p2, "s")[0])


def test_import_with_no_room_refuses_and_leaks_nothing(ckpt):
    _, _, bundle = first_turn(ckpt)
    b = engine(ckpt, num_kv_pages=4)  # fewer pages than the session's context needs
    before = held(b)
    assert not b.import_session("s", bundle)
    assert held(b) == before
    assert b.session_state.counters.refused["no_room"] == 1


def test_other_layout_is_refused(ckpt):
    """Not another TP degree: tensors travel unsharded (tests/workers/test_tp_state_move.py)."""
    _, _, bundle = first_turn(ckpt)
    b = decode(bundle)
    for field, value in [("dtype", "torch.bfloat16"), ("page_size", 8)]:
        layout = BundleLayout(**{**b.layout.__dict__, field: value})
        other = encode(StateBundle(layout, b.token_ids, b.checkpoints, b.tensors))
        eng = engine(ckpt)
        assert not eng.import_session("s", other)
        assert eng.session_state.counters.refused == {field: 1}
