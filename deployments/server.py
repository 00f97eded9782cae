"""LLMServer: the Serve deployment — an OpenAI FastAPI ingress around one AsyncEngine.

The engine is injected (`engine_factory`, an import path), so the same deployment runs under a
real `serve.run` with a fake engine in tests. With tp_size > 1 the executor's TP workers land in
this replica's placement group (bundle index = rank), so a replica and its workers come and go
together.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

from fastapi import FastAPI
from ray import serve

from deployments.args import AppArgs
from deployments.async_engine import AsyncEngine, EngineLike
from deployments.model_source import resolve_model, served_model_name
from deployments.openai_api import ApiConfig, build_openai_app

log = logging.getLogger(__name__)


def build_engine(args: AppArgs) -> EngineLike:
    """The real engine (the default `engine_factory`)."""
    from shortconv.config import EngineConfig
    from shortconv.engine import LLMEngine

    model_dir = resolve_model(args)
    log.info("loading %s (tp_size=%d, %s)", model_dir, args.tp_size, args.device)
    return LLMEngine(
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
        ),
    )


def import_attr(path: str) -> Any:
    """`pkg.module:attr` (or `pkg.module.attr`) -> the attribute."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@serve.deployment(name="LLMServer")
@serve.ingress()
class LLMServer:
    """One replica: engine loop + OpenAI routes + session ownership reports for the router."""

    async def __init__(self, args: dict[str, Any], engine_factory: str | None = None) -> None:
        self.args = AppArgs.model_validate(args)
        factory = import_attr(engine_factory) if engine_factory else build_engine
        # NOTE: loading happens off the event loop so the replica stays responsive to Serve.
        engine = await asyncio.to_thread(factory, self.args)
        self.engine = AsyncEngine(
            engine,
            max_num_seqs=self.args.max_num_seqs,
            max_waiting_requests=self.args.max_waiting_requests,
            session_ttl_s=self.args.session_ttl_s,
        )
        self.engine.start()
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        log.info("replica %s ready", self.replica_id)

    def __serve_build_asgi_app__(self) -> FastAPI:
        cfg = ApiConfig(
            model_name=served_model_name(self.args),
            replica_id=self.replica_id,
            api_key=self.args.api_key,
            max_request_bytes=self.args.max_request_bytes,
        )
        return build_openai_app(self.engine, cfg)

    async def check_health(self) -> None:
        """Serve's health check: the engine loop must be alive and every TP worker answer."""
        await self.engine.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        """Sessions this replica holds state for (session id -> last activity, epoch seconds);
        SessionAffinityRouter routes their next turns here. Only this changes the stats, so
        Serve re-broadcasts them only when a session comes, goes or takes a turn."""
        return {"sessions": dict(self.engine.stats().get("sessions", {}))}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
