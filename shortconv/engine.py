"""LLMEngine: tokenizer + scheduler + executor, stepped by the caller (sync; no Ray imports)."""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from shortconv.allocators import PageAllocator, SlotAllocator
from shortconv.config import ConfigError, EngineConfig, ModelConfig, resolve_dtype
from shortconv.executor import BaseExecutor, ExecutorError
from shortconv.metrics import MetricsRecorder
from shortconv.outputs import RequestOutput
from shortconv.request import Request
from shortconv.runner import Capacity
from shortconv.sampling_params import SamplingParams
from shortconv.scheduler import Scheduler, SchedulerConfig
from shortconv.stats import EngineStats
from shortconv.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


def plan_capacity(
    cfg: ModelConfig, eng: EngineConfig, max_len: int, dtype: torch.dtype
) -> Capacity:
    # Spare slots beyond max_num_seqs hold kept session checkpoints.
    slots = eng.num_state_slots or 2 * eng.max_num_seqs + 1
    if eng.num_kv_pages:
        return Capacity(slots, eng.num_kv_pages)
    per_seq = -(-max_len // eng.kv_page_size)
    n_attn = max(1, len(cfg.attention_layer_ids))
    page_bytes = 2 * n_attn * eng.kv_page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    budget_pages = max(2, eng.kv_cache_bytes // page_bytes)
    return Capacity(slots, int(min(1 + eng.max_num_seqs * per_seq, budget_pages)))


class LLMEngine:
    def __init__(
        self,
        model: str | Path,
        tp_size: int = 1,
        dtype: str = "auto",
        device: str = "cpu",
        seed: int = 0,
        engine_config: EngineConfig | None = None,
        executor: BaseExecutor | None = None,
    ) -> None:
        self.model_dir = Path(model)
        self.model_cfg = ModelConfig.from_dir(self.model_dir)
        self.engine_cfg = eng = engine_config or EngineConfig()
        self.dtype = resolve_dtype(dtype, self.model_cfg.raw)
        self.device = torch.device(device)
        self.max_model_len = eng.max_model_len or self.model_cfg.max_model_len
        if self.max_model_len > self.model_cfg.max_model_len:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={self.model_cfg.max_model_len}"
            )
        self.capacity = plan_capacity(self.model_cfg, eng, self.max_model_len, self.dtype)
        self.max_model_len = _fit_max_len(self.max_model_len, self.capacity, eng)
        self.tokenizer = Tokenizer.load(self.model_dir)
        self.seed = seed
        self._ids = itertools.count()
        self.executor = executor or self._make_executor(tp_size)
        eos = set(self.model_cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(
            SchedulerConfig(
                eng.max_num_seqs,
                eng.max_num_batched_tokens,
                self.max_model_len,
                eng.kv_page_size,
                tuple(sorted(eos)),
            ),
            SlotAllocator(self.capacity.num_slots),
            PageAllocator(self.capacity.num_pages),
        )
        self._outputs: dict[str, RequestOutput] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._counts = {"prompt": 0, "generation": 0, "cached": 0}
        self._finished: dict[str, int] = {}
        extra = _extra_state(self.model_cfg)
        self._pools = ("conv",) + ((extra,) if extra else ())
        # Set by shortconv.metrics.attach_metrics; None: no metrics work at all.
        self.metrics: MetricsRecorder | None = None

    def _make_executor(self, tp_size: int) -> BaseExecutor:
        args = (
            self.model_dir,
            self.model_cfg,
            self.engine_cfg,
            self.capacity,
            self.dtype,
            self.device,
        )
        if tp_size == 1:
            from workers.local_executor import LocalExecutor

            return LocalExecutor(*args)
        from workers.ray_executor import RayExecutor

        return RayExecutor(*args, tp_size=tp_size)

    # ---- requests -----------------------------------------------------------------------
    def encode_prompt(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"{self.model_dir} has no tokenizer files: pass prompt_token_ids instead of text"
            )
        return self.tokenizer.encode(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens but the maximum model length is "
                f"{self.max_model_len} (including at least one generated token)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this checkpoint has none")

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> str:
        """Queue a request. With `session_id`, state is kept after it finishes and the
        session's next turn resumes from it when its prompt extends this one's tokens."""
        prompt_token_ids = list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        n = next(self._ids)
        rid = request_id if request_id is not None else f"req-{n}"
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + n)
        self.scheduler.add(Request(rid, prompt_token_ids, params, seed, session_id=session_id))
        self._outputs[rid] = RequestOutput(
            rid,
            prompt_token_ids,
            logprobs=[] if params.logprobs is not None else None,
            top_logprobs=[] if params.logprobs else None,
        )
        if self.tokenizer is not None:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer, params.stop)
        if self.metrics is not None:
            self.metrics.request_added(rid)
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        out = self._outputs.pop(request_id, None)
        self._detok.pop(request_id, None)
        if out is not None and req is not None:
            out.finish_reason = req.finish_reason or "abort"
            self._count_finished(out.finish_reason)
        if self.metrics is not None:  # refreshed now: an idle engine may run no further step
            self.metrics.request_dropped(request_id)
            self.metrics.record(self.stats())
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        try:
            result = self.executor.execute(plan)
        except ExecutorError as exc:
            outs = self._fail_all(str(exc))
        else:
            updated = self.scheduler.update(plan, result)
            outs = [self._emit_or_fail(req) for req in updated]
        if self.metrics is not None:
            self.metrics.step_done(self.stats(), plan, outs, time.perf_counter() - start)
        return outs

    def _emit_or_fail(self, req: Request) -> RequestOutput:
        """`_emit`; a host-side failure of one request (detokenizer, stop strings) fails that
        request alone, freeing its slot and pages, and the rest of the batch goes on."""
        try:
            return self._emit(req)
        except Exception as exc:
            log.exception("request %s failed", req.request_id)
            if not req.finished:
                self.scheduler.finish(req, "error")
            out = self._outputs.pop(req.request_id, None)
            out = out or RequestOutput(req.request_id, list(req.prompt_token_ids))
            self._detok.pop(req.request_id, None)
            out.finish_reason, out.error = "error", f"{type(exc).__name__}: {exc}"
            self._count_finished("error")
            return out

    def _emit(self, req: Request) -> RequestOutput:
        out = self._outputs[req.request_id]
        if not out.token_ids:  # first token: the prompt is done
            self._counts["prompt"] += len(req.prompt_token_ids)
            self._counts["cached"] += req.num_cached_tokens
        self._counts["generation"] += 1
        out.num_cached_tokens = req.num_cached_tokens
        tok = req.output_token_ids[-1]
        out.new_token_ids = [tok]
        out.token_ids.append(tok)
        if out.logprobs is not None:
            out.logprobs.append(req.output_logprobs[-1])
        if out.top_logprobs is not None:
            out.top_logprobs.append(req.output_top_logprobs[-1])
        detok = self._detok.get(req.request_id)
        out.new_text = ""
        if detok is not None:
            out.new_text = detok.push([tok])
            if detok.stopped and not req.finished:
                self.scheduler.finish(req, "stop")
            elif req.finished:
                out.new_text += detok.flush()
            out.text += out.new_text
        if req.finished:
            out.finish_reason = req.finish_reason
            self._count_finished(req.finish_reason)
            self._outputs.pop(req.request_id, None)
            self._detok.pop(req.request_id, None)
        return out

    def _fail_all(self, message: str) -> list[RequestOutput]:
        failed = []
        for rid in list(self.scheduler.requests):
            req = self.scheduler.requests[rid]
            self.scheduler.finish(req, "error")
            out = self._outputs.pop(rid)
            self._detok.pop(rid, None)
            out.finish_reason, out.error = "error", message
            self._count_finished("error")
            failed.append(out)
        log.error("step failed, %d requests failed: %s", len(failed), message)
        return failed

    def _count_finished(self, reason: str | None) -> None:
        key = reason or "unknown"
        self._finished[key] = self._finished.get(key, 0) + 1

    def stats(self) -> EngineStats:
        sch = self.scheduler
        return EngineStats(
            pools=self._pools,
            slots_used=sch.slots.num_used,
            slots_total=sch.slots.capacity,
            kv_pages_used=sch.pages.num_used,
            kv_pages_total=sch.pages.capacity,
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            sessions_held=len(sch.sessions),
            session_hits=sch.sessions.hits,
            session_misses=sch.sessions.misses,
            session_evictions=sch.sessions.evictions,
            prompt_tokens_total=self._counts["prompt"],
            generation_tokens_total=self._counts["generation"],
            cached_tokens_total=self._counts["cached"],
            finished_by_reason=dict(self._finished),
        )

    def shutdown(self) -> None:
        self.executor.shutdown()


def _fit_max_len(max_len: int, capacity: Capacity, eng: EngineConfig) -> int:
    """A sequence must fit the KV pool on its own, or it would preempt itself forever.

    An explicit max_model_len that does not fit is refused; the model's default is capped to
    what fits (like vLLM), with a warning.
    """
    fits = (capacity.num_pages - 1) * eng.kv_page_size
    if max_len <= fits:
        return max_len
    if eng.max_model_len:
        raise ConfigError(
            f"max_model_len={max_len} needs {-(-max_len // eng.kv_page_size)} KV pages but the "
            f"pool has {capacity.num_pages - 1}; raise num_kv_pages / kv_cache_bytes or lower "
            "max_model_len"
        )
    log.warning("KV pool holds %d tokens: capping max_model_len %d -> %d", fits, max_len, fits)
    return fits


def _extra_state(cfg: ModelConfig) -> str | None:
    from shortconv.models.registry import model_class

    return getattr(model_class(cfg.arch), "extra_state_name", None)
