"""Bad adapters are refused at load with the module or file and the reason, and leave the
engine as it was: no name, no slot, the resident adapters' weights untouched."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from lora_adapters import make_adapter
from safetensors.torch import load_file, save_file

from shortconv import LLM, SamplingParams
from shortconv.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoraError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 9, 13, 20, 33]


def _missing_config(d: Path) -> None:
    (d / CONFIG_FILE).unlink()


def _missing_weights(d: Path) -> None:
    (d / WEIGHTS_FILE).unlink()


def _corrupt_weights(d: Path) -> None:
    (d / WEIGHTS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")


def _corrupt_config(d: Path) -> None:
    (d / CONFIG_FILE).write_text("{ r: 4")


def _unknown_module(d: Path) -> None:
    """w1 renamed to a module that is no projection (as an adapter for another model has)."""
    tensors = load_file(str(d / WEIGHTS_FILE))
    renamed = {k.replace(".feed_forward.w1.", ".feed_forward.gate."): v for k, v in tensors.items()}
    save_file(renamed, str(d / WEIGHTS_FILE))


def _dora(d: Path) -> None:
    cfg = json.loads((d / CONFIG_FILE).read_text())
    (d / CONFIG_FILE).write_text(json.dumps(cfg | {"use_dora": True}))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, Path]:
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora-bad")
    ckpt = make_tiny_checkpoint("lfm2", root / "base", seed=0)
    make_adapter("lfm2", root / "good", seed=1)
    llm = LLM(
        ckpt,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules={"good": str(root / "good")},
    )
    yield llm, root
    llm.shutdown()


def _tokens(llm: LLM, name: str | None) -> list[int]:
    rid = llm.engine.add_request(PROMPT, GREEDY, lora_name=name)
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.finished and out.request_id == rid:
                tokens = out.token_ids
    return tokens


BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing_config": (_missing_config, "no adapter_config.json"),
    "missing_weights": (_missing_weights, "no adapter_model.safetensors"),
    "corrupt_weights": (_corrupt_weights, "not a readable safetensors"),
    "corrupt_config": (_corrupt_config, "not readable JSON"),
    "dora": (_dora, r"unsupported PEFT options \['use_dora'\]"),
    "unknown_module": (
        _unknown_module,
        "target module 'model.layers.0.feed_forward.gate' is not a projection",
    ),
}


def _assert_unchanged(llm: LLM, before: list[int]) -> None:
    assert llm.engine.lora_names() == ["good"]
    assert llm.engine.loras is not None and list(llm.engine.loras.slots.resident) == ["good"]
    assert _tokens(llm, "good") == before


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_files_are_refused(env: tuple[LLM, Path], case: str) -> None:
    llm, root = env
    before = _tokens(llm, "good")
    d = root / case
    make_adapter("lfm2", d, seed=2)
    breaker, message = BROKEN[case]
    breaker(d)
    with pytest.raises(LoraError, match=message):
        llm.engine.load_lora(case, str(d))
    _assert_unchanged(llm, before)


@pytest.mark.parametrize(
    ("case", "kwargs", "message"),
    [
        ("rank16", {"rank": 16}, "rank 16 is above max_lora_rank 8"),
        (
            "other_base",
            {"overrides": {"hidden_size": 96}},
            r"model\.layers\.0\.conv\.in_proj is \[288 x 96\] in the adapter",
        ),
    ],
)
def test_adapters_that_do_not_fit_the_model_are_refused(
    env: tuple[LLM, Path], case: str, kwargs: dict, message: str
) -> None:
    """Checked against every layer before any slot is written: the resident adapter's
    tokens do not move, though the refused one took (and gave back) the free slot."""
    llm, root = env
    before = _tokens(llm, "good")
    make_adapter("lfm2", root / case, seed=3, **kwargs)
    with pytest.raises(LoraError, match=message):
        llm.engine.load_lora(case, str(root / case))
    _assert_unchanged(llm, before)


def test_a_name_loaded_twice_and_an_unknown_name(env: tuple[LLM, Path]) -> None:
    llm, root = env
    before = _tokens(llm, "good")
    with pytest.raises(LoraError, match="'good' is already loaded"):
        llm.engine.load_lora("good", str(root / "good"))
    with pytest.raises(LoraError, match="unknown LoRA adapter 'nope'"):
        llm.engine.add_request(PROMPT, GREEDY, lora_name="nope")
    assert not llm.engine.has_unfinished()
    _assert_unchanged(llm, before)
    assert before != _tokens(llm, None), "the adapter must change the tokens"
