"""The draft model of `speculative_config.method = "draft_model"`: checked and built at start-up.

The draft runs in the engine's own process (rank 0's, the scheduler's), unsharded, with a
state pool and KV pages of its own sized for the target's `max_num_seqs`. At tp_size > 1 it
still runs once, on the driver: a small draft is cheap next to the target, and proposing on
one process keeps the proposals out of the step message every rank receives.
"""

from __future__ import annotations

import logging
from pathlib import Path

from shortconv.cache.kv_groups import kv_groups
from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.configs.speculative import SpeculativeConfig
from shortconv.engine.draft_proposer import DraftProposer
from shortconv.engine.tokenizer import Tokenizer
from shortconv.errors import ConfigError
from shortconv.execution.parallel import SINGLE
from shortconv.execution.runner import ModelRunner
from shortconv.execution.worker_spec import Capacity, WorkerSpec
from shortconv.sampling.draft_sampler import DraftSampler

log = logging.getLogger(__name__)


def build_draft_proposer(
    target: WorkerSpec, target_tokenizer: Tokenizer | None, cfg: SpeculativeConfig
) -> DraftProposer:
    """The draft's runner and proposer; ConfigError when the draft cannot serve this target."""
    assert cfg.model is not None  # SpeculativeConfig requires it for draft_model
    draft_dir = Path(cfg.model)
    draft_cfg = ModelConfig.from_dir(draft_dir)
    check_same_vocabulary(target, target_tokenizer, draft_dir, draft_cfg)
    spec = draft_worker_spec(target, draft_dir, draft_cfg)
    log.info(
        "speculative decoding: draft %s (%s, %d layers) runs unsharded in the engine process",
        draft_dir.name,
        draft_cfg.arch,
        draft_cfg.num_layers,
    )
    eng = target.engine_cfg
    runner, sampler = ModelRunner(spec, SINGLE), DraftSampler()
    runner.sampler = sampler  # bound once: the proposer reads q of every draw from it
    return DraftProposer(
        runner, sampler, spec.capacity, eng.kv_page_size, eng.max_num_batched_tokens
    )


def check_same_vocabulary(
    target: WorkerSpec,
    target_tokenizer: Tokenizer | None,
    draft_dir: Path,
    draft_cfg: ModelConfig,
) -> None:
    """Acceptance compares token ids, so the draft must mean by each id what the target does."""
    names = f"target {target.model_dir.name} and draft {draft_dir.name}"
    if draft_cfg.vocab_size != target.model_cfg.vocab_size:
        raise ConfigError(
            f"speculative_config: {names} differ in vocab_size "
            f"({target.model_cfg.vocab_size} vs {draft_cfg.vocab_size}); a draft model must "
            "share the target's tokenizer and vocabulary"
        )
    draft_tokenizer = Tokenizer.load(draft_dir)
    if _vocab(target_tokenizer) != _vocab(draft_tokenizer):
        raise ConfigError(
            f"speculative_config: {names} have different tokenizers (their token-to-id maps "
            "differ); a draft model must share the target's tokenizer and vocabulary"
        )


def _vocab(tokenizer: Tokenizer | None) -> dict[str, int] | None:
    return dict(tokenizer.hf.get_vocab()) if tokenizer is not None else None


def draft_worker_spec(target: WorkerSpec, draft_dir: Path, draft_cfg: ModelConfig) -> WorkerSpec:
    """The draft's pools: per request a committed slot and a scratch slot (proposing runs on a
    copy: `engine.draft_proposer`), and pages for max_model_len positions in every KV group
    (a sliding group keeps them all: the draft frees nothing behind its windows).

    NOTE: k proposals after a request's last token reach position num_tokens - 1 + k - 1, and
    `Speculator.limit` keeps num_tokens + k <= max_model_len, so k adds no positions."""
    eng = target.engine_cfg
    need = target.max_model_len
    if draft_cfg.max_model_len < need:
        raise ConfigError(
            f"speculative_config: draft {draft_dir.name} holds {draft_cfg.max_model_len} "
            f"positions, fewer than the target's max_model_len {need}"
        )
    per_seq = -(-need // eng.kv_page_size)
    pages = 1 + eng.max_num_seqs * per_seq
    groups = len(kv_groups(draft_cfg))
    capacity = Capacity(1 + 2 * eng.max_num_seqs, pages, (pages,) * (groups - 1))
    draft_eng = EngineConfig(
        max_num_seqs=eng.max_num_seqs,
        max_num_batched_tokens=eng.max_num_batched_tokens,
        kv_page_size=eng.kv_page_size,
        max_model_len=target.max_model_len,
        enable_graphs=False,  # proposal steps are few rows; the draft decodes eagerly
        enable_prefix_caching=False,
        cpu_kernels=eng.cpu_kernels,
        quantization=eng.quantization,
    )
    return WorkerSpec(
        draft_dir, draft_cfg, draft_eng, capacity, target.dtype, target.device, target.max_model_len
    )
