"""The ingress's record of LoRA adapters loaded at run time through it: name -> directory.

A runtime-loaded adapter lives on the replica that loaded it; the router sends its requests
there (deployments/serve/lora_holders.py). When no live replica holds it (the holder is gone,
or full and the request spilled), the replica that gets the request loads it first, from the
directory this record puts in the request's context. The YAML's `lora_modules` are on every
replica from its start, so they need no record.
"""

from __future__ import annotations

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
