"""`response_format` (structured outputs) at the HTTP edge: the request models, the schema
checks that answer 400 naming the field, and the engine GrammarSpec they become."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.frontend.openai.errors import APIError
from shortconv.sampling.grammar import GrammarSpec
from shortconv.sampling.grammar.schema_check import find_unsupported

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for schema and function names


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    # NOTE: the alias: `schema` shadows a BaseModel attribute.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec.json_object()
        if self.json_schema is None:
            raise APIError(
                "response_format type 'json_schema' needs a json_schema object",
                param="response_format.json_schema",
            )
        schema = self.json_schema.schema_
        check_json_schema(schema, "response_format.json_schema.schema")
        return GrammarSpec.json_schema(schema)


def check_json_schema(schema: Any, param: str) -> None:
    """400 naming the spot: not a valid JSON schema (Draft 2020-12), or a construct the grammar
    cannot enforce (shortconv.sampling.grammar.schema_check)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = ".".join([param, *(str(p) for p in exc.path)])
        raise APIError(f"{where}: invalid JSON schema: {exc.message}", param=where) from None
    bad = find_unsupported(schema)
    if bad is not None:
        where = f"{param}.{bad[0]}" if bad[0] != "schema" else param
        raise APIError(f"{where}: {bad[1]}", param=where)
