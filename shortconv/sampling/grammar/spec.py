"""What a constrained request asks for: frozen, hashable, so it keys the compiled-grammar cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "json_object"]


class GrammarError(ValueError):
    """A grammar we cannot build or enforce; `param` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """`json_schema`: output is one JSON document valid under `schema` (canonical JSON text);
    `json_object`: output is one JSON object (any keys)."""

    kind: GrammarKind
    schema: str | None = None

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> GrammarSpec:
        # NOTE: canonical text (sorted keys would reorder properties, which xgrammar emits in
        # declaration order, so only the separators are normalised).
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "json_object"):
            raise GrammarError(f"unknown grammar kind {self.kind!r}")
        if (self.kind == "json_schema") != (self.schema is not None):
            raise GrammarError("a json_schema grammar needs a schema, and only it takes one")
