"""LLMServer: the model deployment — the OpenAI FastAPI app around one AsyncEngine, served to
OpenAIIngress (deployments/ingress.py) through `forward`.

The engine is injected (`engine_factory`, an import path), so the same deployment runs under a
real `serve.run` with a fake engine in tests. With tp_size > 1 the executor's TP workers land in
this replica's placement group (bundle index = rank), so a replica and its workers come and go
together.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from ray import serve

from deployments.args import AppArgs
from deployments.asgi_forward import ForwardedRequest, Message, PrefixRecord, run_asgi
from deployments.async_engine import AsyncEngine, EngineLike
from deployments.metrics_sink import attach_ray_metrics
from deployments.model_source import resolve_model, served_model_name
from deployments.openai_api import ApiConfig, build_openai_app, resolve_api_key

log = logging.getLogger(__name__)

MAX_RECORDED_PREFIXES = 4096  # prefix hashes a replica reports (a few KiB in its stats)
RESET_PREFIX_CACHE_PATH = "/v1/internal/reset_prefix_cache"


def build_engine(args: AppArgs) -> EngineLike:
    """The real engine (the default `engine_factory`)."""
    from shortconv.configs.config import EngineConfig
    from shortconv.llm import build_engine as build_llm_engine

    model_dir = resolve_model(args)
    log.info("loading %s (tp_size=%d, %s)", model_dir, args.tp_size, args.device)
    graphs: dict[str, Any] = {"enable_graphs": args.enable_graphs}
    if args.graph_batch_sizes is not None:  # None keeps the engine's default ladder
        graphs["graph_batch_sizes"] = tuple(args.graph_batch_sizes)
    engine = build_llm_engine(
        model_dir,
        tp_size=args.tp_size,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        engine_config=EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_state_slots=args.num_state_slots,
            max_model_len=args.max_model_len,
            prepack_cpu_weights=args.prepack_cpu_weights,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_checkpoint_interval=args.prefix_checkpoint_interval,
            num_checkpoint_slots=args.num_checkpoint_slots,
            **graphs,
        ),
    )
    return engine


def import_attr(path: str) -> Any:
    """`pkg.module:attr` (or `pkg.module.attr`) -> the attribute."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@serve.deployment(name="LLMServer")
class LLMServer:
    """One replica: engine loop + OpenAI routes + session and prefix reports for the router.

    HTTP reaches it only through OpenAIIngress (`forward`, a handle call the router can route
    on the prompt's prefix key), which runs it through this replica's own OpenAI FastAPI app.
    NOTE: not a `@serve.ingress` itself: Serve allows one FastAPI ingress per application."""

    async def __init__(self, args: dict[str, Any], engine_factory: str | None = None) -> None:
        self.args = AppArgs.model_validate(args)
        factory = import_attr(engine_factory) if engine_factory else build_engine
        # NOTE: loading happens off the event loop so the replica stays responsive to Serve.
        engine = await asyncio.to_thread(factory, self.args)
        # NOTE: before the loop starts, so every series exists (at 0) from the replica's start;
        # inside a replica Ray tags them with application, deployment and replica.
        attach_ray_metrics(engine)
        self.engine = AsyncEngine(
            engine,
            admission_limit=self.args.admission_limit,
            session_ttl_s=self.args.session_ttl_s,
        )
        self.engine.start()
        self.prefixes = PrefixRecord(MAX_RECORDED_PREFIXES)
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.app = self._build_api()
        log.info("replica %s ready", self.replica_id)

    def _build_api(self) -> FastAPI:
        cfg = ApiConfig(
            model_name=served_model_name(self.args),
            replica_id=self.replica_id,
            api_key=resolve_api_key(self.args.api_key),
            max_request_bytes=self.args.max_request_bytes,
            request_timeout_s=self.args.request_timeout_s,
        )
        return build_openai_app(self.engine, cfg)

    async def check_health(self) -> None:
        """Serve's health check: the engine loop must be alive and every TP worker answer."""
        await self.engine.check_health()

    async def forward(
        self, req: ForwardedRequest, prefix_hashes: list[int] | None = None
    ) -> AsyncIterator[Message]:
        """Serve one HTTP request from the ingress through this replica's FastAPI app: yields
        the response start, then body chunks. `prefix_hashes` (the router reads them from the
        call's kwargs) are recorded once the request succeeded: its prompt is now cached here."""
        status = 0
        async for message in run_asgi(self.app, req):
            if message["type"] == "http.response.start":
                status = int(message["status"])
            yield message
        if status == 200 and req.method == "POST" and req.path.endswith(RESET_PREFIX_CACHE_PATH):
            self.prefixes.clear()  # the cache is empty now: claim nothing
        elif status == 200 and prefix_hashes:
            self.prefixes.add(prefix_hashes)

    def record_routing_stats(self) -> dict[str, Any]:
        """Sessions this replica holds state for (session id -> last activity, epoch seconds)
        and the prefix hashes of prompts it served (sorted ints); SessionAffinityRouter sends
        a session's next turn, or a request with a known prefix, here. Serve re-broadcasts the
        stats only when they change: a session comes, goes or takes a turn, a prefix is new."""
        return {
            "sessions": dict(self.engine.stats().get("sessions", {})),
            "prefixes": self.prefixes.report(),
        }

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
