"""Graph-captured decode with a sliding-window KV group (the tiny LFM3, CPU buffer protocol):
decode far past the window replays buckets whose window block tables are persistent buffers
refreshed in place, and decodes what the eager engine and the oracle decode."""

from __future__ import annotations

import pytest
from oracle import assert_matches_oracle, oracle_greedy

from shortconv import SamplingParams
from shortconv.configs.config import EngineConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.llm import build_engine
from shortconv.tiny.checkpoint import build_hf_model

pytestmark = pytest.mark.skipif(
    transformers_lacks("lfm3") is not None, reason=str(transformers_lacks("lfm3"))
)
PAGE = 4


def test_graph_decode_past_the_window_matches_eager_and_the_oracle(tmp_path) -> None:
    hf = build_hf_model("lfm3", seed=11)
    hf.save_pretrained(str(tmp_path))
    prompts = [[5, 9, 23, 7, 11, 40, 41], [3, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
    w = hf.config.sliding_window
    n = 8 * w
    outs = {}
    for graphs in (True, False):
        cfg = EngineConfig(
            kv_page_size=PAGE,
            enable_graphs=graphs,
            max_num_seqs=4,
            graph_batch_sizes=(1, 2, 4),
            graph_context_sizes=(16, 64),
        )
        eng = build_engine(tmp_path, dtype="float32", engine_config=cfg)
        ids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=n)) for p in prompts]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
        outs[graphs] = [done[i].token_ids for i in ids]
        if graphs:
            stats = eng.graph_stats()
            assert stats is not None and stats.replays > 4 * w  # contexts up to 64 replayed
            assert stats.eager_fallbacks["no_bucket"] > 0  # contexts past 64 ran eagerly
            assert sum(stats.replay_failures.values()) == 0
        eng.flush_prefix_cache()  # the cached checkpoints hold their windows' pages till now
        assert eng.scheduler.cache_manager.windows[0].pages.num_used == 0
    assert outs[True] == outs[False]
    for prompt, toks in zip(prompts, outs[True], strict=True):
        assert_matches_oracle(toks, oracle_greedy(hf, prompt, n), f"graphs len={len(prompt)}")
