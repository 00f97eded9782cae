"""The JSON-schema subset the grammar enforces. xgrammar silently ignores some keywords
(`multipleOf` on numbers, `not`, `uniqueItems`, ...), which would let output through that the
schema forbids; so every keyword outside this list is refused up front, naming where it is."""

from __future__ import annotations

from typing import Any

# Keywords that constrain the output and that the grammar enforces exactly.
ENFORCED = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "$ref",
        "$defs",
        "definitions",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minProperties",
        "maxProperties",
    }
)
# Keywords that document a schema and constrain nothing.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
# Only formats whose grammar is exact: xgrammar's `date` admits 2024-11-31, for one.
FORMATS = frozenset({"uuid"})
_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})

# Where subschemas sit: keyword -> how its value holds them.
_ONE = ("items", "additionalProperties")
_MAP = ("properties", "$defs", "definitions")
_LIST = ("anyOf", "prefixItems")


def find_unsupported(schema: Any, path: str = "") -> tuple[str, str] | None:
    """(path, why) of the first construct the grammar cannot enforce, else None. Paths are
    dotted from the schema root ("properties.tags.uniqueItems")."""
    if not isinstance(schema, dict):
        return (path or "schema", "a schema must be a JSON object")
    for key, value in schema.items():
        where = f"{path}.{key}" if path else key
        if key not in ENFORCED and key not in ANNOTATIONS:
            return (where, f"the JSON-schema keyword {key!r} is not supported")
        bad = _check_value(key, value, where)
        if bad is not None:
            return bad
    return None


def _check_value(key: str, value: Any, where: str) -> tuple[str, str] | None:
    if key == "format" and value not in FORMATS:
        return (where, f"format {value!r} is not supported (supported: {sorted(FORMATS)})")
    if key == "type":
        types = value if isinstance(value, list) else [value]
        if not types or any(t not in _TYPES for t in types):
            return (where, f"type must be one of {sorted(_TYPES)}, got {value!r}")
    if key == "enum" and (not isinstance(value, list) or not value):
        return (where, "enum must be a non-empty array")
    if key in _ONE:
        if isinstance(value, bool):  # additionalProperties / items: false (or true)
            return None
        return find_unsupported(value, where)
    if key in _MAP:
        if not isinstance(value, dict):
            return (where, f"{key} must be an object of schemas")
        for name, sub in value.items():
            bad = find_unsupported(sub, f"{where}.{name}")
            if bad is not None:
                return bad
    if key in _LIST:
        if not isinstance(value, list) or not value:
            return (where, f"{key} must be a non-empty array of schemas")
        for i, sub in enumerate(value):
            bad = find_unsupported(sub, f"{where}.{i}")
            if bad is not None:
                return bad
    return None
