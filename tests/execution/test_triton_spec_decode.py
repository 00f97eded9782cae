"""Speculative decoding on the GPU (Triton) path, on CPU under `TRITON_INTERPRET=1`: verify rows
run the Triton extend kernels (short conv, CCA, paged attention, fused MoE) and give what the
same path gives with speculation off, for n-gram and draft-model proposals."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from triton_path import force_triton_path

from shortconv.configs.config import EngineConfig
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

pytest.importorskip("triton")

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [7, 8, 7, 8, 7, 8, 7], [6, 7, 8, 10, 6, 7, 8, 10, 6]]
# Fewer layers than the presets (each costs the interpreter seconds), every stateful kind kept:
# LFM2-MoE's attention layer is a MoE one, LFM3 keeps a sliding layer (window 8: two 4-token
# pages) beside its full one.
OVERRIDES = {
    "lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},
    # The preset's 4 layers: cut to 2, this vocabulary-16 MoE repeats one token whatever its
    # state (every conv window alike), and a wrong rollback could not show.
    "lfm2_moe": {},
    "lfm3": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "conv", "full_attention"],
    },
    "zaya1": {"num_hidden_layers": 2},
}


def generate(path: Path, spec: dict[str, object] | None) -> tuple[list[list[int]], int, int]:
    cfg = EngineConfig(speculative_config=spec, kv_page_size=4)  # type: ignore[arg-type]
    eng = build_engine(path, dtype="float32", engine_config=cfg)
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    done: dict[str, list[int]] = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    stats = eng.stats()
    proposed, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    return [done[i] for i in ids], proposed, accepted


def tiny(arch: str, out: Path) -> Path:
    overrides = {"vocab_size": 16, **OVERRIDES[arch]}
    return make_tiny_checkpoint(arch, out / arch, overrides, seed=11, with_tokenizer=False)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("triton_spec")
    return {arch: tiny(arch, base) for arch in OVERRIDES}


@pytest.fixture(scope="module")
def refs() -> dict[str, list[list[int]]]:
    """Each target's output with speculation off on the Triton path, filled by the first test
    that needs it (the interpreter makes each run cost seconds)."""
    return {}


def reference(arch: str, paths: dict[str, Path], refs: dict[str, list[list[int]]]) -> list:
    if arch not in refs:
        refs[arch] = generate(paths[arch], None)[0]
    return refs[arch]


@pytest.mark.parametrize("arch", sorted(OVERRIDES))
def test_verify_rows_on_the_triton_path(
    arch: str, paths: dict[str, Path], refs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter[str] = force_triton_path(monkeypatch)
    ref = reference(arch, paths, refs)
    ours, proposed, accepted = generate(paths[arch], SPEC)
    assert ours == ref
    assert 0 < accepted < proposed, (proposed, accepted)
    assert calls["paged_attention_extend_triton"] > 0, calls


@pytest.mark.parametrize("arch", sorted(OVERRIDES))
def test_a_draft_model_on_the_triton_path(
    arch: str, paths: dict[str, Path], refs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each target with a draft of another architecture (ZAYA1; LFM2 for ZAYA1): both the
    target's verify rows and the draft's catch-up and proposal forwards run the Triton
    kernels."""
    draft = paths["lfm2" if arch == "zaya1" else "zaya1"]
    calls: Counter[str] = force_triton_path(monkeypatch)
    ref = reference(arch, paths, refs)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    ours, proposed, accepted = generate(paths[arch], spec)
    assert ours == ref
    assert 0 < accepted < proposed, (proposed, accepted)
    assert calls["paged_attention_extend_triton"] > 0, calls
