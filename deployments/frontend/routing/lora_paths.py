"""The ingress's record of LoRA adapters loaded at run time through it: name -> directory.

A runtime-loaded adapter lives on the replica that loaded it; the router sends its requests
there (deployments/serve/lora_holders.py). When no live replica holds it (the holder is gone,
or full and the request spilled), the replica that gets the request loads it first, from the
directory this record puts in the request's context. The YAML's `lora_modules` are on every
replica from its start, so they need no record. `/v1/models` lists one replica's adapters and
this record's, so every replica's answer names every adapter the service holds.
"""

from __future__ import annotations

from typing import Any

from deployments.frontend.openai.loras import adapter_cards
from deployments.frontend.openai.replica import RequestContext


class LoraPaths:
    def __init__(self) -> None:
        self.paths: dict[str, str] = {}

    def context(
        self, session_id: str | None, prefix: tuple[int, ...], model: str | None
    ) -> RequestContext:
        """A request's context: `model` is its adapter (the ingress cleared the base's name)."""
        path = self.paths.get(model) if model is not None else None
        return RequestContext(session_id, prefix, model, path)

    def loaded(self, name: str, path: str) -> None:
        self.paths[name] = path

    def unloaded(self, name: str) -> None:
        self.paths.pop(name, None)

    def with_runtime_loads(self, body: dict[str, Any]) -> dict[str, Any]:
        """One replica's `/v1/models` body (the base's card first) plus the adapters loaded at
        run time through this ingress that it does not hold: they live on other replicas."""
        listed = {card["id"] for card in body["data"]}
        others = {n: p for n, p in self.paths.items() if n not in listed}
        if not others:
            return body
        base = body["data"][0]
        return {
            **body,
            "data": [*body["data"], *adapter_cards(others, base["id"], base["created"])],
        }
