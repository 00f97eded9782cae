"""JSON schemas the structured-output tests decode under (each bounded, so that even a random
model's output has to end within a few dozen tokens), and the ones that must be refused."""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    req = list(props) if required is None else required
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


_INT = {"type": "integer", "minimum": 0, "maximum": 9}

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested-object": _obj(
        {
            "user": _obj(
                {
                    "name": {"type": "string", "minLength": 1, "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99},
                }
            )
        }
    ),
    "array-min-max-items": {
        "type": "array",
        "items": {"type": "boolean"},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "booleans": _obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}}),
    "integer-bounds": _obj(
        {
            "n": {"type": "integer", "minimum": 10, "maximum": 20},
            "m": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
        }
    ),
    "string-pattern": _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    "string-lengths": {"type": "string", "minLength": 3, "maxLength": 5},
    "additional-properties-false": _obj(
        {"x": _INT, "y": {"type": "string", "maxLength": 4}}, required=["x"]
    ),
    "array-of-objects": {
        "type": "array",
        "minItems": 1,
        "maxItems": 3,
        "items": _obj(
            {
                "id": {"type": "integer", "minimum": 1, "maximum": 100},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
            }
        ),
    },
    "any-of-null": _obj(
        {"v": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 5}]}}
    ),
    "ref-and-const": {
        "$defs": {"pt": _obj({"x": _INT, "y": _INT})},
        **_obj(
            {"kind": {"const": "line"}, "a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}
        ),
    },
    "format-uuid": _obj({"id": {"type": "string", "format": "uuid"}}),
    "prefix-items-closed": {
        "type": "array",
        "prefixItems": [{"type": "boolean"}, _INT, {"type": ["string", "null"], "maxLength": 3}],
        "items": False,
    },
    "number-bounds": _obj({"p": {"type": "number", "minimum": -1.5, "maximum": 2.25}}),
}

# Refused with a 400 naming the keyword: the grammar would not enforce these.
UNSUPPORTED: dict[str, tuple[dict[str, Any], str]] = {
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    "not": (_obj({"a": {"not": {"type": "string"}}}), "properties.a.not"),
    "uniqueItems": ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
    # xgrammar's date grammar admits 2024-11-31
    "format-date": ({"type": "string", "format": "date"}, "format"),
}
# Not JSON schemas at all.
INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "bad-type": ({"type": "strin"}, "type"),
    "bad-minimum": ({"type": "integer", "minimum": "zero"}, "minimum"),
    "bad-required": ({"type": "object", "required": "a"}, "required"),
}
