"""The replica's tokenizer, loaded beside the core's build instead of sent in `Ready`, is the
engine's: the in-process engine's tokenizer is the oracle (what the core used to send)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments.frontend.config.args import AppArgs
from deployments.frontend.engine.core_client import CoreEngine
from deployments.frontend.engine.engine_build import build_engine
from shortconv.tiny.checkpoint import make_tiny_checkpoint

TEXTS = ["hello world", "a longer line, with punctuation: 12 + 30 = 42!"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=4)


def test_replica_tokenizer_is_the_engines(ckpt: Path) -> None:
    args = {"model": str(ckpt), "dtype": "float32", "max_num_seqs": 2}
    oracle = build_engine(AppArgs.model_validate(args))
    core = CoreEngine.spawn(args, None, 1)
    try:
        ours, want = core.tokenizer, oracle.tokenizer
        assert ours is not None and ours is not want
        for text in TEXTS:
            ids = want.encode(text)
            assert ours.encode(text) == ids and ours.decode(ids) == want.decode(ids)
        assert (ours.eos_token_id, ours.vocab_size) == (want.eos_token_id, want.vocab_size)
        chat = [{"role": "user", "content": TEXTS[0]}]
        assert ours.apply_chat_template(chat) == want.apply_chat_template(chat)
    finally:
        core.shutdown()
        oracle.shutdown()
