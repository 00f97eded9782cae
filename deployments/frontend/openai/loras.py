"""A replica's LoRA adapters as the OpenAI surface sees them (vLLM's names and answers).

A request picks its adapter by `model`: the base's served name (or none) is the base model, a
loaded adapter's name is that adapter, anything else a 404 `model_not_found`. `/v1/models`
lists the base and every adapter loaded here, each with `parent` = the base (and `root` = its
directory). `POST /v1/load_lora_adapter` / `unload_lora_adapter` change the set at run time;
the engine reads and checks the files (shortconv/lora/), on its own thread or process, and a
refusal is a 400 with its message (an unknown name to unload: 404). The names here are the
engine's: those loaded at start (`lora_modules`) and those loaded through this replica.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.openai.errors import APIError

_STRICT = ConfigDict(extra="forbid", strict=True)


class LoadLoraRequest(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    model_config = _STRICT
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraRequest(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` body (`lora_int_id` is vLLM's; not used here)."""

    model_config = _STRICT
    lora_name: str = Field(min_length=1, max_length=256)


def unknown_model(name: str) -> APIError:
    message = f"the model {name!r} does not exist"
    return APIError(message, 404, param="model", code="model_not_found")


def adapter_cards(paths: dict[str, str], parent: str, created: int) -> list[dict[str, Any]]:
    """`/v1/models` entries of adapters (name -> directory) on base `parent`, vLLM's shape."""
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "shortconv-serve",
            "root": path,
            "parent": parent,
        }
        for name, path in sorted(paths.items())
    ]


class ReplicaLoras:
    """The adapters this replica's engine holds, by name (-> directory), for one base name."""

    def __init__(self, base_name: str, lora_modules: dict[str, str] | None) -> None:
        self.base_name = base_name
        self.paths: dict[str, str] = dict(lora_modules or {})
        # When `paths` last changed (epoch seconds): the router weighs this replica's report
        # of them against its own records by it, as it does sessions' claims.
        self.changed_at = time.time()
        self._lock = asyncio.Lock()  # NOTE: one load or unload at a time, so a miss loads once

    def adapter_for(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base), or a 404."""
        if model is None or model == self.base_name:
            return None
        if model not in self.paths:
            raise unknown_model(model)
        return model

    def cards(self, created: int) -> list[dict[str, Any]]:
        """`/v1/models` entries of the adapters, vLLM's shape."""
        return adapter_cards(self.paths, self.base_name, created)

    async def ensure(self, engine: AsyncEngine, name: str | None, path: str | None) -> None:
        """Load on miss: a request for an adapter another replica loaded at run time brings
        its directory (the ingress's record); without one, `adapter_for` answers the 404."""
        if name is None or path is None or name in self.paths:
            return
        await self.load(engine, LoadLoraRequest(lora_name=name, lora_path=path))

    async def load(self, engine: AsyncEngine, req: LoadLoraRequest) -> dict[str, Any]:
        async with self._lock:
            return await self._load(engine, req)

    async def _load(self, engine: AsyncEngine, req: LoadLoraRequest) -> dict[str, Any]:
        if req.lora_name == self.base_name:
            raise APIError(f"{req.lora_name!r} is the base model's name", param="lora_name")
        error = await engine.update_lora("load", req.lora_name, req.lora_path)
        if error is not None:
            message = f"cannot load LoRA adapter {req.lora_name!r}: {error}"
            raise APIError(message, param="lora_path")
        self.paths[req.lora_name] = req.lora_path
        self.changed_at = time.time()
        return {"object": "lora_adapter", "lora_name": req.lora_name, "status": "loaded"}

    async def unload(self, engine: AsyncEngine, req: UnloadLoraRequest) -> dict[str, Any]:
        async with self._lock:
            return await self._unload(engine, req)

    async def _unload(self, engine: AsyncEngine, req: UnloadLoraRequest) -> dict[str, Any]:
        if req.lora_name not in self.paths:
            raise unknown_model(req.lora_name)
        error = await engine.update_lora("unload", req.lora_name)
        if error is not None:
            message = f"cannot unload LoRA adapter {req.lora_name!r}: {error}"
            raise APIError(message, param="lora_name")
        del self.paths[req.lora_name]
        self.changed_at = time.time()
        return {"object": "lora_adapter", "lora_name": req.lora_name, "status": "unloaded"}
