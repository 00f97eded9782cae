"""LLMEngine: tokenizer + scheduler + executor, stepped by the caller (sync; no Ray imports)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future

from shortconv.cache.allocators import PageAllocator, SlotAllocator
from shortconv.cache.sessions import SessionPins
from shortconv.cache.window_pages import window_groups
from shortconv.engine.draft_proposer import DraftProposer
from shortconv.engine.executor import BaseExecutor, ExecutorError
from shortconv.engine.forks import seq_ids
from shortconv.engine.images import AnyImage, ImageSpec, PlacedImage
from shortconv.engine.model_facts import checkpoint_bytes, extra_state_name
from shortconv.engine.occupancy import engine_stats
from shortconv.engine.outputs import FinishReason, RequestOutput
from shortconv.engine.request import Request
from shortconv.engine.request_limits import RequestLimits
from shortconv.engine.scheduler import Scheduler, SchedulerConfig
from shortconv.engine.session_state import SessionState
from shortconv.engine.session_store import SessionStore
from shortconv.engine.stats import EngineStats, GraphStats, StartupReport
from shortconv.engine.token_output import take_token
from shortconv.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from shortconv.execution.worker_spec import WorkerSpec
from shortconv.lora.adapter import LoraError
from shortconv.lora.engine_loras import EngineLoras
from shortconv.metrics.recorder import MetricsRecorder
from shortconv.sampling.grammar.runtime import GrammarRuntime
from shortconv.sampling.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LLMEngine:
    """Scheduler + tokenizer over an executor it is given (the facade, `shortconv.llm`,
    picks the executor; the engine never names one)."""

    def __init__(
        self,
        spec: WorkerSpec,
        executor: BaseExecutor,
        seed: int = 0,
        tokenizer: Future[Tokenizer | None] | None = None,
    ) -> None:
        """`tokenizer`: the checkpoint's, being loaded meanwhile (`shortconv.llm.build_engine`);
        None: loaded here."""
        self.spec = spec
        self.model_dir, self.model_cfg = spec.model_dir, spec.model_cfg
        self.engine_cfg = spec.engine_cfg
        self.dtype, self.device, self.capacity = spec.dtype, spec.device, spec.capacity
        self.max_model_len = spec.max_model_len
        self.tokenizer = tokenizer.result() if tokenizer else Tokenizer.load(self.model_dir)
        self.seed = seed
        self._ids = itertools.count()
        self.executor = executor
        eng = self.engine_cfg
        draft = _build_draft(spec, self.tokenizer)
        eos = set(self.model_cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.stop_ids = tuple(sorted(eos))  # the scheduler's and the grammar runtime's
        hf = self.tokenizer.hf if self.tokenizer is not None else None
        self.grammars = GrammarRuntime(hf, self.model_cfg.vocab_size, list(self.stop_ids))
        self.scheduler = Scheduler(
            SchedulerConfig(
                eng.max_num_seqs,
                eng.max_num_batched_tokens,
                self.max_model_len,
                eng.kv_page_size,
                self.stop_ids,
                enable_prefix_caching=eng.enable_prefix_caching,
                session_ttl_s=eng.session_ttl_s,
                checkpoint_interval=eng.checkpoint_interval,
                max_prefill_tokens_while_decoding=eng.prefill_tokens_while_decoding(self.device),
                speculative=eng.speculative_config,
            ),
            SlotAllocator(self.capacity.num_slots),
            PageAllocator(self.capacity.num_pages),
            window_groups(self.model_cfg, self.capacity.window_pages),
            draft,
            grammar=self.grammars,
        )
        store = SessionStore(eng.session_store) if eng.session_store is not None else None
        self.session_state = SessionState(
            self.scheduler.cache_manager, executor, self.model_dir, str(self.dtype), store
        )
        if (speculative := eng.speculative_config) is not None:
            k, model = speculative.num_speculative_tokens, speculative.model
            drafting = f", draft {model}" if model is not None else ""
            log.info("speculative decoding: method %s%s, k=%d", speculative.method, drafting, k)
        self.image_spec = ImageSpec.of(self.model_cfg)  # None: a text-only model
        self.limits = RequestLimits(
            self.model_cfg.arch,
            self.model_cfg.vocab_size,
            self.max_model_len,
            self.engine_cfg.max_n,
            self.tokenizer is not None,
            self.image_spec,
        )
        self._outputs: dict[str, RequestOutput] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._counts = {"prompt": 0, "generation": 0, "cached": 0, "images": 0}
        self._encoder_seconds = 0.0
        self._finished: dict[str, int] = {}
        extra = extra_state_name(self.model_cfg)
        self._pools = ("conv",) + ((extra,) if extra else ())
        self.checkpoint_bytes = checkpoint_bytes(spec)  # one checkpoint, whole model
        self.weight_bytes = executor.weight_bytes()  # rank 0's, by dtype (a metrics gauge)
        self.loras: EngineLoras | None = None
        if eng.enable_lora:
            self.loras = EngineLoras(executor, eng.max_loras, eng.max_lora_rank, self._busy_slots)
            for name, path in (eng.lora_modules or {}).items():
                self.loras.load(name, path)
        # Set by shortconv.metrics.recorder.attach_metrics; None: no metrics work at all.
        self.metrics: MetricsRecorder | None = None

    # ---- requests -----------------------------------------------------------------------
    def encode_prompt(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"{self.model_dir} has no tokenizer files: pass prompt_token_ids instead of text"
            )
        return self.tokenizer.encode(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.limits.validate(prompt_token_ids, params)
        if params.grammar is not None:
            self.grammars.check(params.grammar)  # GrammarError (a ValueError) naming the field

    def place_images(
        self,
        prompt_token_ids: list[int],
        images: Sequence[AnyImage],
        n: int = 1,
    ) -> tuple[PlacedImage, ...]:
        """Each image's placeholders in the prompt, or InvalidRequest naming what is wrong.
        (Kept state is keyed by each image's digest too: `engine.images.key_stream`.)"""
        return self.limits.place_images(prompt_token_ids, images, n)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
        images: Sequence[AnyImage] = (),
        lora_name: str | None = None,
    ) -> str:
        """Queue a request. With `session_id`, state is kept after it finishes and the
        session's next turn resumes from it when its prompt extends this one's tokens.
        `images` fill the prompt's image placeholders in order (engine.images). `lora_name`:
        a loaded LoRA adapter to apply (LoraError if unknown)."""
        prompt_token_ids = list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        placed = self.place_images(prompt_token_ids, images, params.n)
        if session_id is not None:
            self.session_state.restore(session_id)  # a stored session resumes from its file
        n = next(self._ids)
        rid = request_id if request_id is not None else f"req-{n}"
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + n)
        req = Request(rid, prompt_token_ids, params, seed, session_id=session_id, images=placed)
        if lora_name is not None:
            self._lora_engine().bind(req, lora_name)
        elif self.loras is not None:
            self.loras.counters.request(None)  # the base's requests beside the adapters'
        self.scheduler.add(req)
        for key, index in seq_ids(rid, params.n):
            self._outputs[key] = RequestOutput(
                rid,
                prompt_token_ids,
                logprobs=[] if params.logprobs is not None else None,
                top_logprobs=[] if params.logprobs else None,
                index=index,
            )
            if self.tokenizer is not None:
                self._detok[key] = IncrementalDetokenizer(
                    self.tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens
                )
        if self.metrics is not None:
            self.metrics.request_added(rid, params.n)
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request, every fork of it too; returns its (first fork's) output."""
        req = self.scheduler.abort(request_id)
        n = req.params.n if req is not None and req.parent is None else 1  # a fork: itself
        outs = [self._outputs.pop(key, None) for key, _ in seq_ids(request_id, n)]
        for key, _ in seq_ids(request_id, n):
            self._detok.pop(key, None)
        out = outs[0]
        for o in outs:
            if o is not None and req is not None:
                o.finish_reason = o.finish_reason or FinishReason.ABORT
                self._count_finished(o.finish_reason)
        if self.metrics is not None:  # refreshed now: an idle engine may run no further step
            self.metrics.request_dropped(request_id)
        self.refresh_metrics()
        return out

    # ---- LoRA adapters ------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter under `name` (LoraError naming the module and reason)."""
        try:
            self._lora_engine().load(name, path)
        finally:  # NOTE: loaded or refused, both counted: an idle engine runs no step
            self.refresh_metrics()

    def unload_lora(self, name: str) -> None:
        self._lora_engine().unload(name)
        self.refresh_metrics()

    def lora_names(self) -> list[str]:
        return sorted(self.loras.slots.names) if self.loras is not None else []

    def _lora_engine(self) -> EngineLoras:
        if self.loras is None:
            raise LoraError("LoRA adapters need enable_lora=True")
        return self.loras

    def _busy_slots(self) -> set[int]:
        return {r.lora_slot for r in self.scheduler.requests.values() if r.lora_slot >= 0}

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        # NOTE: the plan carries its grammar masks already (`engine.step_rows`); a request
        # whose grammar could not go on has left it, to be reported here.
        outs = [self._fail_request(req, why) for req, why in self.scheduler.take_failed()]
        try:
            result = self.executor.execute(plan) if plan.seqs else None
        except ExecutorError as exc:
            outs += self._fail_all(str(exc))
        else:
            updated = self.scheduler.update(plan, result) if result is not None else []
            self._counts["images"] += len(plan.encoder_inputs)
            self._encoder_seconds += result.encoder_seconds if result is not None else 0.0
            outs += [self._emit_or_fail(req) for req in updated]
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
            return self._fail_request(req, f"{type(exc).__name__}: {exc}")

    def _fail_request(self, req: Request, message: str) -> RequestOutput:
        """End one request with an error, freeing its slot and pages."""
        if not req.finished:
            self.scheduler.finish(req, FinishReason.ERROR)
        out = self._outputs.pop(req.request_id, None)
        if out is None:
            rid = req.parent.request_id if req.parent is not None else req.request_id
            out = RequestOutput(rid, list(req.prompt_token_ids), index=req.index)
        self._detok.pop(req.request_id, None)
        self.grammars.release(req.request_id)
        out.finish_reason, out.error = FinishReason.ERROR, message
        self._count_finished(FinishReason.ERROR)
        return out

    def _emit(self, req: Request) -> RequestOutput:
        """The step's new tokens of req (several after a verify row), one at a time as a step
        of one token would give them: a grammar completed or a stop string matched before the
        last cuts the rest."""
        out = self._outputs[req.request_id]
        if not out.token_ids and out.index == 0:  # first token: the prompt is done (once)
            self._counts["prompt"] += len(req.prompt_token_ids)
            self._counts["cached"] += req.num_cached_tokens
        out.num_cached_tokens = req.num_cached_tokens
        out.new_token_ids, out.new_text = [], ""
        first = len(req.output_token_ids) - req.num_new_tokens
        for i in range(first, len(req.output_token_ids)):
            last = i == len(req.output_token_ids) - 1
            detok = self._detok.get(req.request_id)
            if take_token(self.grammars, detok, req, out, i, done=last and req.finished):
                # NOTE: cut inside a verify row's run: the state folded in tokens past the
                # cut, so it is not kept as the end-of-generation checkpoint.
                del req.output_token_ids[i + 1 :]
                del req.output_logprobs[i + 1 :]
                del req.output_top_logprobs[i + 1 :]
                self.scheduler.finish(req, FinishReason.STOP, keep_state=last)
                break
        self._counts["generation"] += len(out.new_token_ids)
        if self.loras is not None:
            self.loras.counters.generated(req.lora_name, len(out.new_token_ids))
        if req.finished:
            out.finish_reason = req.finish_reason
            self._count_finished(req.finish_reason)
            self._outputs.pop(req.request_id, None)
            self._detok.pop(req.request_id, None)
        return out

    def _fail_all(self, message: str) -> list[RequestOutput]:
        failed = []
        for req in list(self.scheduler.requests.values()):
            if not req.finished:  # a parent's forks left with it
                self.scheduler.finish(req, FinishReason.ERROR)
        for key in list(self._outputs):
            out = self._outputs.pop(key)
            self._detok.pop(key, None)
            out.finish_reason, out.error = FinishReason.ERROR, message
            self._count_finished(FinishReason.ERROR)
            failed.append(out)
        log.error("step failed, %d requests failed: %s", len(failed), message)
        return failed

    def _count_finished(self, reason: FinishReason | None) -> None:
        key = str(reason or "unknown")
        self._finished[key] = self._finished.get(key, 0) + 1

    def stats(self) -> EngineStats:
        return engine_stats(
            self.scheduler,
            self._pools,
            self._counts,
            self._finished,
            self.checkpoint_bytes,
            self._encoder_seconds,
            self.weight_bytes,
            self.session_state.counters,
            self.loras,
        )

    def export_session(self, session_id: str) -> bytes | None:
        """The session's kept state as a state bundle (`cache.state_bundle`); None when this
        engine keeps none for it."""
        return self.session_state.export(session_id)

    def import_session(self, session_id: str, bundle: bytes) -> bool:
        """Take a bundle in as the session's kept state, so its next turn resumes from it;
        False (counted by reason, nothing held) when the bundle does not fit this engine."""
        return self.session_state.import_(session_id, bundle)

    def flush_prefix_cache(self) -> int:
        """Drop every prefix-cache entry (kept sessions' checkpoints too): after it, an idle
        engine holds no slot and no page. Returns how many entries were dropped."""
        dropped = self.scheduler.cache_manager.flush()
        self.refresh_metrics()
        return dropped

    # ---- health and introspection (the Serve layer's view:
    # deployments.frontend.engine.engine_types) ---
    @property
    def sessions(self) -> SessionPins:
        """Sessions' pins on kept checkpoints (TTL, eviction, the ids this engine holds)."""
        return self.scheduler.cache_manager.sessions

    def check_health(self) -> None:
        """Raise ExecutorError when the executor (a TP worker) is unusable."""
        self.executor.check_health()

    def graph_stats(self) -> GraphStats | None:
        """Cumulative graph-replay counters, or None (graphs off, or held by remote ranks)."""
        return self.executor.graph_stats()

    def startup_reports(self) -> list[StartupReport]:
        """The TP rank processes' start-up reports (none when the model runs in this one)."""
        return self.executor.startup_reports()

    def refresh_metrics(self) -> None:
        """Push the current stats to the attached metrics (an idle engine runs no step)."""
        if self.metrics is not None:
            self.metrics.record(self.stats())

    def shutdown(self) -> None:
        self.session_state.spill_all()  # NOTE: before the ranks go: their state is read
        self.executor.shutdown()


def _build_draft(spec: WorkerSpec, tokenizer: Tokenizer | None) -> DraftProposer | None:
    """method draft_model's proposer (the draft runs in this process: `engine.draft_model`)."""
    speculative = spec.engine_cfg.speculative_config
    if speculative is None or speculative.method != "draft_model":
        return None
    from shortconv.engine.draft_model import build_draft_proposer

    return build_draft_proposer(spec, tokenizer, speculative)
