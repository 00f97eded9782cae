"""A request body before its schema: JSON parsing with the edge's refusals, and pydantic's
validation errors turned into OpenAI error objects naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from deployments.frontend.openai.errors import APIError

# Pydantic names the union member that failed in `loc` ("str", "list[int]", ...); a client
# wants the field path only.
_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)(\[.*\])?$|.*[\[(]")


def from_validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    parts = []
    for p in err.get("loc", ()):
        if isinstance(p, str) and (p == "body" or _UNION_TAG.match(p)):
            continue
        parts.append(str(p))
    param = ".".join(parts) or None
    return APIError(f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param=param)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or APIError (400): not UTF-8, not JSON, NaN/Infinity (not
    JSON, though Python accepts them), ints past Python's digit limit, nesting past the
    recursion limit, or a lone surrogate escape ("\\ud800", which no tokenizer can encode)."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError too
        raise APIError(f"request body is not valid JSON: {exc}"[:500]) from None
    if not isinstance(data, dict):
        raise APIError("request body must be a JSON object")
    bad = _lone_surrogate_at(data)
    if bad is not None:
        raise APIError(f"{bad}: not valid Unicode (lone surrogate escape)", param=bad)
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _lone_surrogate_at(data: Any) -> str | None:
    """Path of the first string (value or key) that cannot be encoded as UTF-8, else None."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # NOTE: iterative: the depth is already bounded by json's recursion limit
        path, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                sub = f"{path}.{k}" if path else str(k)
                stack += [(path or "body", k), (sub, x)]
        elif isinstance(v, list):
            stack += [(f"{path}.{i}", x) for i, x in enumerate(v)]
    return None
