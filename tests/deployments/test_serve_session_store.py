"""Durable sessions through `serve run deployments/lfm2.yaml` with `session_store: {path}`:
the app serves turn 1 of five sessions and is stopped (the replica's engine core spills every
held session at shutdown); a new app on the same store serves turn 2 of each. The oracle is the
same two turns on an app without a store that never restarted: equal text, and turn 2 resumes
what that app resumed (`cached_tokens`). Three sessions' files are damaged: a flipped byte, a
truncated file, and a bundle of the same prompt from another checkpoint of the same shape
(other weights). Each of those turns re-prefills (no cached tokens) with equal text, and each
refusal is counted by reason in `/v1/internal/stats`. Three app starts, one at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_apps import openai_client, yaml_app

from shortconv.cache.state_bundle import decode
from shortconv.configs.config import EngineConfig
from shortconv.configs.session_store import SessionStoreConfig
from shortconv.engine.session_store import SessionStore
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

SESSIONS = ("s0", "s1", "s2", "s3", "s4")
# session -> (damage done to its file, the refusal reason counted)
DAMAGED = {
    "s2": ("flip", "checksum"),
    "s3": ("truncate", "checksum"),
    "s4": ("other", "fingerprint"),
}
ASK: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0}


def first_turn(sid: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{sid}: remember me, I am {sid} and I like {sid}."}]


def second_turn(sid: str, answer: str) -> list[dict[str, str]]:
    return [
        *first_turn(sid),
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And now, what next?"},
    ]


def chat(base: str, sid: str, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """One greedy turn of session `sid` -> (text, cached_tokens, prompt_tokens)."""
    client = openai_client(base)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"x-session-id": sid},
        **ASK,
    )
    details = r.usage.prompt_tokens_details if r.usage else None
    cached = details.cached_tokens or 0 if details else 0
    return r.choices[0].message.content or "", cached, r.usage.prompt_tokens if r.usage else 0


def stats(base: str) -> dict[str, Any]:
    return httpx.get(f"{base}/v1/internal/stats", timeout=30).json()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {"oracle": {}, "one": {}, "two": {}}
    with yaml_app("lfm2", tmp_path_factory) as url:  # no store, never restarted
        for sid in SESSIONS:
            text1 = chat(url, sid, first_turn(sid))[0]
            found["oracle"][sid] = (text1, chat(url, sid, second_turn(sid, text1)))
    store_dir = tmp_path_factory.mktemp("store")
    store_args = {"session_store": {"path": str(store_dir)}}
    with yaml_app("lfm2", tmp_path_factory, graceful=True, **store_args) as url:
        for sid in SESSIONS:
            found["one"][sid] = chat(url, sid, first_turn(sid))
    store = SessionStore(SessionStoreConfig(path=str(store_dir)))
    found["spilled"] = {sid: store.file_of(sid).is_file() for sid in SESSIONS}
    for sid, (damage, _) in DAMAGED.items():
        if found["spilled"][sid]:
            _damage(store, sid, damage, tmp_path_factory.mktemp("other"))
    with yaml_app("lfm2", tmp_path_factory, **store_args) as url:
        for sid in SESSIONS:
            found["two"][sid] = chat(url, sid, second_turn(sid, found["one"][sid][0]))
        found["stats"] = stats(url)
    yield found


def _damage(store: SessionStore, sid: str, damage: str, scratch: Path) -> None:
    path = store.file_of(sid)
    data = path.read_bytes()
    if damage == "flip":
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x20
        path.write_bytes(bytes(flipped))
    elif damage == "truncate":
        path.write_bytes(data[: len(data) * 2 // 3])
    else:
        store.save(sid, _other_checkpoints_bundle(data, scratch))


def _other_checkpoints_bundle(data: bytes, scratch: Path) -> bytes:
    """The same prompt's kept state from a checkpoint of the same shape with other weights (the
    app's tiny LFM2 is seed 0), at the app's dtype and page size."""
    b = decode(data)
    prompt = list(b.token_ids[: b.checkpoints[0].num_tokens])
    other = make_tiny_checkpoint("lfm2", scratch / "lfm2", seed=1)
    cfg = EngineConfig(kv_page_size=b.layout.page_size)
    eng = build_engine(other, dtype=b.layout.dtype.removeprefix("torch."), engine_config=cfg)
    eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0), session_id="s")
    while eng.has_unfinished():
        eng.step()
    bundle = eng.export_session("s")
    assert bundle is not None and decode(bundle).layout.fingerprint != b.layout.fingerprint
    return bundle


def test_shutdown_spilled_every_session(runs: dict[str, Any]) -> None:
    assert runs["spilled"] == dict.fromkeys(SESSIONS, True)


def test_turn_one_equals_the_oracle(runs: dict[str, Any]) -> None:
    for sid in SESSIONS:
        assert runs["one"][sid][0] == runs["oracle"][sid][0], sid


# NOTE: an app's session pins two checkpoints (turn 1's prompt end and its last token), and
# the next chat turn, re-rendered by the template, often resumes from the prompt end: the
# bundle carries both, so the restored session resumes as the never-restarted app does.
@pytest.mark.parametrize("sid", [s for s in SESSIONS if s not in DAMAGED])
def test_restored_session_resumes_its_history_with_equal_text(
    runs: dict[str, Any], sid: str
) -> None:
    text, cached, prompt = runs["two"][sid]
    want_text, want_cached, want_prompt = runs["oracle"][sid][1]
    assert text == want_text
    assert prompt == want_prompt
    turn1 = runs["one"][sid][2]
    # the same history as the app that kept it in memory
    assert cached == want_cached > 0, f"turn 1's prompt: {turn1} tokens"


@pytest.mark.parametrize("sid", sorted(DAMAGED))
def test_damaged_file_reprefills_with_equal_text(runs: dict[str, Any], sid: str) -> None:
    text, cached, _ = runs["two"][sid]
    want_text, want_cached, _ = runs["oracle"][sid][1]
    assert cached == 0 < want_cached  # not resumed from the refused file
    assert text == want_text


def test_each_refusal_is_counted_by_reason(runs: dict[str, Any]) -> None:
    st = runs["stats"]
    want: dict[str, int] = {}
    for _, reason in DAMAGED.values():
        want[reason] = want.get(reason, 0) + 1
    assert {r: n for r, n in st["session_state_refused"].items() if n} == want
    assert st["session_state_bundles"]["restored"] == len(SESSIONS) - len(DAMAGED)
