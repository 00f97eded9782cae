"""OpenAIReplica: the OpenAI routes' work on a replica, behind the typed hop (no HTTP here).

The ingress has already checked auth, the body size, JSON, the request schema and the model
name (deployments/serve/ingress.py); this side checks what needs the model: the chat template, the
tokenizer, the context length, the sampling fields, grammars and the engine's admission. Every
refusal is an `APIError` raised before anything is generated (a stream raises it before its
first chunk), naming the request field it blames. No Ray here: testable on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.engine.engine_types import Delta, EngineDead, EngineOverloaded
from deployments.frontend.images.chat_images import ChatImages
from deployments.frontend.images.limits import ImageLimits
from deployments.frontend.openai.deltas import Accumulator, by_choice, collect, merge, with_deadline
from deployments.frontend.openai.errors import RETRY_AFTER_S, APIError
from deployments.frontend.openai.format import Formatter, StreamUsage
from deployments.frontend.openai.handoff import (
    DecodeHandoff,
    PrefillCall,
    PrefillResult,
    prefill_state,
)
from deployments.frontend.openai.loras import LoadLoraRequest, ReplicaLoras, UnloadLoraRequest
from deployments.frontend.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_context,
)
from deployments.frontend.openai.replica import Reply, RequestContext
from deployments.frontend.openai.tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    render_chat,
    tokenize,
)
from deployments.frontend.openai.tools import ToolPlan, chat_grammar, plan_tools
from deployments.frontend.routing.prefix_record import PrefixRecord
from deployments.frontend.tools.parsers import parser_for_template
from deployments.frontend.tools.stream import special_pattern
from shortconv.sampling.grammar import GrammarError
from shortconv.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shortconv.engine.images import AnyImage

MAX_RECORDED_PREFIXES = 4096  # prefix hashes a replica reports (a few KiB in its stats)


@dataclass(frozen=True)
class ApiConfig:
    model_name: str
    replica_id: str = "local"
    request_timeout_s: float = 600.0  # from queueing to the last token; then aborted
    lora_modules: tuple[tuple[str, str], ...] = ()  # LoRA adapters the engine loads at start


@dataclass(frozen=True)
class _Job:
    """One generation request, ready for the engine: one engine request per prompt, each with
    `params.n` forks (choices), the prompt counted once in usage."""

    prompts: list[list[int]]
    params: SamplingParams
    fmt: Formatter
    usage: StreamUsage
    grammar_param: str = "response_format"  # the field a grammar that fails to compile names
    images: tuple[AnyImage, ...] = ()  # a chat prompt's images, in order
    lora_name: str | None = None  # the LoRA adapter the request's `model` names

    def accumulators(self) -> list[Accumulator]:
        n = self.params.n
        return [
            Accumulator(num_prompt_tokens=len(p) * (j == 0)) for p in self.prompts for j in range(n)
        ]


class OpenAIReplica:
    """The `Replica` methods (deployments/frontend/openai/replica.py) over one AsyncEngine."""

    def __init__(
        self,
        engine: AsyncEngine,
        cfg: ApiConfig,
        images: ChatImages | None = None,
        handoff: DecodeHandoff | None = None,
    ) -> None:
        self.engine, self.cfg = engine, cfg
        self.handoff = handoff  # a decode replica of a disaggregated app (handoff.py)
        self.images = images or ChatImages(ImageLimits(), None)  # default: no images
        self.startup: dict[str, Any] = {}  # the replica's start-up report (LLMServer fills it)
        self.prefixes = PrefixRecord(MAX_RECORDED_PREFIXES)
        self.loras = ReplicaLoras(cfg.model_name, dict(cfg.lora_modules))
        self.created = int(time.time())
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = int(engine.engine.max_model_len)
        hf = getattr(self.tokenizer, "hf", None)
        self.tool_parser = parser_for_template(getattr(hf, "chat_template", None))
        added = getattr(hf, "added_tokens_decoder", {}).values()
        keep = (self.tool_parser.start, self.tool_parser.end) if self.tool_parser else ()
        self.drop_specials = special_pattern([t.content for t in added if t.special], keep)

    # ---- generation -------------------------------------------------------------------------
    async def chat(self, request: ChatCompletionRequest, ctx: RequestContext) -> Reply:
        return await self._whole(await self._chat_job(request, ctx), ctx)

    async def chat_stream(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> AsyncIterator[Reply]:
        async for reply in self._stream(await self._chat_job(request, ctx), ctx):
            yield reply

    async def completion(self, request: CompletionRequest, ctx: RequestContext) -> Reply:
        return await self._whole(await self._completion_job(request, ctx), ctx)

    async def completion_stream(
        self, request: CompletionRequest, ctx: RequestContext
    ) -> AsyncIterator[Reply]:
        async for reply in self._stream(await self._completion_job(request, ctx), ctx):
            yield reply

    # ---- the rest ---------------------------------------------------------------------------
    async def tokenize(self, request: TokenizeRequest) -> Reply:
        tok = self._need_tokenizer("prompt" if request.messages is None else "messages")
        body = tokenize(tok, request, self.max_model_len, self._token_text)
        return self._reply(body)

    async def detokenize(self, request: DetokenizeRequest) -> Reply:
        return self._reply(detokenize(self._need_tokenizer("tokens"), request))

    def _need_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer", param=param)
        return self.tokenizer

    async def models(self) -> Reply:
        card = {"id": self.cfg.model_name, "object": "model", "created": self.created}
        card.update(owned_by="shortconv-serve", max_model_len=self.max_model_len)
        return self._reply({"object": "list", "data": [card, *self.loras.cards(self.created)]})

    async def load_lora(self, request: LoadLoraRequest, ctx: RequestContext) -> Reply:
        """`ctx` names the adapter for the router, which records where the load went."""
        return self._reply(await self.loras.load(self.engine, request))

    async def unload_lora(self, request: UnloadLoraRequest, ctx: RequestContext) -> Reply:
        """`ctx` names the adapter for the router, which sends the call to its holder."""
        return self._reply(await self.loras.unload(self.engine, request))

    async def _adapter(self, model: str | None, ctx: RequestContext) -> str | None:
        """The adapter `model` names (loaded here first on a miss, when `ctx` says where
        from), or None for the base; a 404 for a name nobody loaded."""
        await self.loras.ensure(self.engine, ctx.lora_name, ctx.lora_path)
        return self.loras.adapter_for(model)

    async def health(self) -> Reply:
        """Pings the engine loop and every TP worker; 503 when either is unusable."""
        try:
            await self.engine.check_health()
        except Exception as exc:
            raise APIError(f"unhealthy: {exc}", 503, "server_error", code="unhealthy") from None
        return self._reply({"status": "ok"})

    async def prefill(self, call: PrefillCall) -> PrefillResult:
        """A prefill replica's one call: fill the prompt's state and return it as a bundle
        (deployments/frontend/openai/handoff.py)."""
        return await prefill_state(self.engine, call, self.cfg.request_timeout_s)

    async def stats(self) -> Reply:
        body = {"replica_id": self.cfg.replica_id, **self.engine.stats()}
        if self.handoff is not None:
            body["handoff"] = self.handoff.counters.report()
        return self._reply({**body, "startup": self.startup} if self.startup else body)

    async def reset_prefix_cache(self) -> Reply:
        """Drop this replica's prefix cache (kept sessions too); running requests keep their
        own state. vLLM's /reset_prefix_cache, per replica. Its prefix claims go with it."""
        dropped = await self.engine.flush_prefix_cache()
        self.prefixes.clear()
        return self._reply({"replica_id": self.cfg.replica_id, "dropped": dropped})

    # ---- internals --------------------------------------------------------------------------
    def _reply(self, body: dict[str, Any]) -> Reply:
        return Reply(self.cfg.replica_id, body)

    async def _whole(self, job: _Job, ctx: RequestContext) -> Reply:
        accs = job.accumulators()
        await collect(await self._deltas(job, ctx), accs)
        self.prefixes.add(ctx.prefix_hashes)  # its prompt is cached here now
        return self._reply(job.fmt.whole(*accs))

    async def _stream(self, job: _Job, ctx: RequestContext) -> AsyncIterator[Reply]:
        deltas = await self._deltas(job, ctx)  # NOTE: refusals raise here, before any chunk
        async for chunk in job.fmt.chunks(deltas, job.accumulators(), job.usage):
            yield self._reply(chunk)
        self.prefixes.add(ctx.prefix_hashes)

    async def _deltas(self, job: _Job, ctx: RequestContext) -> AsyncIterator[tuple[int, Delta]]:
        """`_start`, after a disaggregated app's decode replica has taken the prompt's state
        from a prefill replica (under the request's session, or a transient one)."""
        if job.params.grammar is not None:  # NOTE: before anything is admitted or prefilled
            with _refusals(job):
                await self.engine.check_grammar(job.params.grammar)
        if self.handoff is None:
            return self._start(job, ctx)
        self._check_context(job)  # NOTE: before a prefill replica spends anything on it
        sid, transient = await self.handoff.session_for(job.prompts, job.images, ctx.session_id)
        if not transient:
            return self._start(job, dataclasses.replace(ctx, session_id=sid))
        assert sid is not None
        try:
            deltas = self._start(job, dataclasses.replace(ctx, session_id=sid))
        except BaseException:
            self.engine.drop_session(sid)
            raise
        return self.handoff.dropping(deltas, sid)

    def _check_context(self, job: _Job) -> None:
        for prompt in job.prompts:
            check_context(len(prompt), job.params.max_tokens, self.max_model_len)

    def _start(self, job: _Job, ctx: RequestContext) -> AsyncIterator[tuple[int, Delta]]:
        """Admit every prompt of the request (or none): their deltas, merged, under the
        request deadline, or an APIError."""
        self._check_context(job)
        rid = job.fmt.request_id
        many = len(job.prompts) > 1
        # NOTE: a prompt refused after others were admitted drops their streams unstarted:
        # nothing was queued, and each gives its admission back when dropped.
        streams = [
            self._admit(p, job, f"{rid}-{i}" if many else rid, None if many else ctx.session_id)
            for i, p in enumerate(job.prompts)
        ]
        merged = merge([with_deadline(d, self.cfg.request_timeout_s) for d in streams])
        return merged if job.params.n == 1 else by_choice(merged, job.params.n)

    def _admit(
        self, prompt: list[int], job: _Job, rid: str, session_id: str | None
    ) -> AsyncIterator[Delta]:
        with _refusals(job):
            return self.engine.generate(
                prompt, job.params, rid, session_id, job.images, job.lora_name
            )

    def _formatter(
        self,
        model: str | None,
        chat: bool,
        want_logprobs: bool,
        tools: ToolPlan | None = None,
        echo: tuple[str, ...] = (),
    ) -> Formatter:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        auto = tools is not None and tools.mode == "auto"
        drop = self.drop_specials if auto else None
        return Formatter(
            chat,
            rid,
            model or self.cfg.model_name,  # NOTE: an adapter's name, as vLLM answers
            self._token_text,
            want_logprobs,
            tools=tools,
            drop_specials=drop,
            echo=echo,
        )

    def _token_text(self, tok: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{tok}"
        return self.tokenizer.decode([tok], skip_special_tokens=False)

    async def _completion_job(self, req: CompletionRequest, ctx: RequestContext) -> _Job:
        lora_name = await self._adapter(req.model, ctx)
        given = req.prompts()
        prompts = [self._encode(p, i if len(given) > 1 else None) for i, p in enumerate(given)]
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        grammar = req.response_format.grammar() if req.response_format else None
        params = req.sampling(max_tokens=max_tokens, logprobs=req.logprobs, grammar=grammar)
        texts = [self._prompt_text(p) for p in given] if req.echo else []
        echo = tuple(t for t in texts for _ in range(params.n))  # one per choice
        fmt = self._formatter(req.model, False, params.logprobs is not None, echo=echo)
        return _Job(prompts, params, fmt, _usage(req), lora_name=lora_name)

    def _encode(self, prompt: str | list[int], index: int | None) -> list[int]:
        where = "prompt" if index is None else f"prompt.{index}"
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer: send token ids", param=where)
        try:
            return self.tokenizer.encode(prompt)
        except Exception as exc:  # a string the tokenizer cannot take is the client's
            raise APIError(f"prompt cannot be tokenized: {exc}", param=where) from None

    def _prompt_text(self, prompt: str | list[int]) -> str:
        """What `echo` returns: the prompt as sent, or its token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            return "".join(self._token_text(t) for t in prompt)
        return self.tokenizer.decode(prompt, skip_special_tokens=False)

    async def _chat_job(self, req: ChatCompletionRequest, ctx: RequestContext) -> _Job:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer, so no chat template", param="messages")
        lora_name = await self._adapter(req.model, ctx)
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)
        grammar, grammar_param = chat_grammar(req.response_format, tools)
        refs, tools_listed, images = req.image_refs(), req.template_tools(), ()
        if refs:  # the multimodal path: the checkpoint's processor renders and expands
            mm = await self.images.prompt(req, refs, tools_listed)
            prompt, images = mm.token_ids, mm.images
        else:
            messages = req.chat_messages()
            prompt = render_chat(self.tokenizer, messages, req.add_generation_prompt, tools_listed)
        requested = req.requested_max_tokens()
        max_tokens = (
            requested if requested is not None else max(1, self.max_model_len - len(prompt))
        )
        params = req.sampling(
            max_tokens=max_tokens,
            logprobs=req.engine_logprobs(),
            grammar=grammar,
            # NOTE: `auto` parses the model's call markers, which are special tokens.
            skip_special_tokens=tools is None or tools.mode != "auto",
        )
        fmt = self._formatter(req.model, True, params.logprobs is not None, tools)
        return _Job([prompt], params, fmt, _usage(req), grammar_param, images, lora_name)


@contextlib.contextmanager
def _refusals(job: _Job) -> Iterator[None]:
    """The engine's refusals of `job`, raised as the APIError the client gets."""
    retry = {"retry-after": str(RETRY_AFTER_S)}
    try:
        yield
    except GrammarError as exc:  # a schema that passed our checks but does not compile
        raise APIError(str(exc), param=job.grammar_param) from None
    except ValueError as exc:  # the engine's own checks: prompt length, ids, stop strings
        raise APIError(str(exc), param=getattr(exc, "param", "prompt")) from None
    except EngineOverloaded as exc:
        raise APIError(
            str(exc), 503, "server_overloaded", code="overloaded", headers=retry
        ) from None
    except EngineDead as exc:
        raise APIError(str(exc), 503, "server_error", code="engine_dead", headers=retry) from None


def _usage(req: ChatCompletionRequest | CompletionRequest) -> StreamUsage:
    return StreamUsage(req.include_usage, req.continuous_usage)
