"""The engine surface the Serve layer relies on, and what the loop hands back per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shortconv.engine.outputs import FinishReason, RequestOutput
from shortconv.sampling.grammar.spec import GrammarError, GrammarSpec
from shortconv.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shortconv.engine.images import AnyImage, ImageSpec
    from shortconv.engine.stats import EngineStats, GraphStats, StartupReport
    from shortconv.metrics.recorder import MetricsRecorder


class SessionsLike(Protocol):
    """The engine's kept sessions, as the loop sees them: expiry and the ids to report."""

    ttl_s: float

    def evict_idle(self) -> int: ...
    def session_ids(self) -> list[str]: ...
    def drop(self, session_id: str) -> None: ...


class EngineLike(Protocol):
    """Everything of `shortconv.engine.llm_engine.LLMEngine` the Serve layer uses (a fake
    implements it); deployments/ reaches no further into the engine than this."""

    max_model_len: int
    tokenizer: Any
    metrics: MetricsRecorder | None  # set by shortconv.metrics.recorder.attach_metrics
    model_dir: Path
    image_spec: ImageSpec | None  # None: a text-only model
    weight_bytes: dict[str, int]  # rank 0's, by storage dtype, read at start-up

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
        images: Sequence[AnyImage] = (),  # NOTE: passed only when there are some
        lora_name: str | None = None,  # NOTE: passed only when set (request_extras)
    ) -> str: ...
    def place_images(
        self, prompt_token_ids: list[int], images: Sequence[AnyImage], n: int = 1
    ) -> Any:
        """Each image's placeholders in the prompt, or InvalidRequest (a vision model only:
        called only for a request with images)."""

    def abort_request(self, request_id: str) -> RequestOutput | None: ...
    def step(self) -> Sequence[RequestOutput | CoreOutput]: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def graph_stats(self) -> GraphStats | None: ...
    def refresh_metrics(self) -> None: ...
    def flush_prefix_cache(self) -> int:
        """Drop every prefix-cache entry; returns how many (0 with caching off)."""

    def check_health(self) -> None:
        """Raise (ExecutorError) when the executor's workers are unusable."""

    @property
    def sessions(self) -> SessionsLike:
        """Kept session state (the engine's session pins)."""

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter under `name`; ValueError (LoraError) naming what is wrong."""

    def unload_lora(self, name: str) -> None:
        """Drop the adapter `name`; ValueError when unknown or still serving requests."""

    def startup_reports(self) -> list[StartupReport]:
        """Each TP rank process's start-up report (none when the model runs in this one)."""

    def export_session(self, session_id: str) -> bytes | None:
        """The session's kept state as a state bundle; None when none is kept."""

    def import_session(self, session_id: str, bundle: bytes) -> bool:
        """Take a bundle in as the session's kept state; False (nothing held) if refused."""

    def shutdown(self) -> None: ...


class EngineOverloaded(RuntimeError):
    """Too many requests are already queued on this replica (HTTP 503)."""


class EngineDead(RuntimeError):
    """The loop thread is gone; the replica must be replaced (HTTP 503, failed health check)."""


@dataclass(frozen=True)
class Delta:
    """What one engine step added to one request (a snapshot: the engine reuses its objects)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...] | None
    top_logprobs: tuple[list[tuple[int, float]] | None, ...] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    index: int = 0  # the fork (choice) of the request this delta is of (`SamplingParams.n`)

    @staticmethod
    def of(out: RequestOutput) -> Delta:
        n = len(out.new_token_ids)
        lps, tops = out.logprobs, out.top_logprobs
        return Delta(
            out.new_text,
            tuple(out.new_token_ids),
            tuple(lps[-n:]) if lps is not None and n else None,
            tuple(tops[-n:]) if tops is not None and n else None,
            out.finish_reason,
            len(out.prompt_token_ids),
            out.num_cached_tokens,
            out.error,
            out.index,
        )

    def then(self, later: Delta) -> Delta:
        """This delta followed by `later` of the same request and fork, as one (a consumer
        that fell behind takes its backlog as one chunk: one message per hop, not one per
        token)."""

        def cat(a: tuple | None, b: tuple | None) -> tuple | None:
            return None if a is None and b is None else (a or ()) + (b or ())

        return Delta(
            self.text + later.text,
            self.token_ids + later.token_ids,
            cat(self.logprobs, later.logprobs),
            cat(self.top_logprobs, later.top_logprobs),
            later.finish_reason,
            later.num_prompt_tokens,
            later.num_cached_tokens,
            later.error,
            later.index,
        )


@dataclass(frozen=True)
class CoreOutput:
    """One request's delta of one step, as an engine in another process hands it over
    (deployments/frontend/engine/core_client.py); the loop takes it where it takes a
    RequestOutput."""

    request_id: str
    delta: Delta

    @property
    def finished(self) -> bool:
        return self.delta.finish_reason is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.delta.finish_reason


def delta_of(out: RequestOutput | CoreOutput) -> Delta:
    """The step's delta of an engine's output, wherever the engine runs."""
    return out.delta if isinstance(out, CoreOutput) else Delta.of(out)


def executor_error(engine: EngineLike) -> str | None:
    """Why `engine`'s executor (its TP workers) is unusable, or None."""
    try:
        engine.check_health()
    except Exception as exc:
        return f"executor health check failed: {exc}"
    return None


def grammar_error(engine: EngineLike, spec: GrammarSpec) -> str | None:
    """Why `spec` does not compile for `engine` (its GrammarError's message), or None. An
    engine with no grammar runtime (an injected fake) checks when the request is added."""
    grammars = getattr(engine, "grammars", None)
    if grammars is None:
        return None
    try:
        grammars.check(spec)
    except GrammarError as exc:
        return str(exc)
    return None


def request_extras(images: Sequence[AnyImage], lora_name: str | None) -> dict[str, Any]:
    """`add_request`'s optional keywords, only those set: an engine without images or LoRA
    (a text-only model, an injected fake) need not take them."""
    extra: dict[str, Any] = {"images": images} if images else {}
    if lora_name is not None:
        extra["lora_name"] = lora_name
    return extra


def update_lora(engine: EngineLike, op: str, name: str, path: str) -> str | None:
    """Run `load_lora` / `unload_lora` on `engine` (its own thread or process); the refusal's
    message, or None. Only the adapter's own errors (ValueError) are answered: anything else
    is a broken engine, raised."""
    try:
        if op == "load":
            engine.load_lora(name, path)
        else:
            engine.unload_lora(name)
    except ValueError as exc:
        return str(exc)
    return None
