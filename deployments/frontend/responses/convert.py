"""The Responses API in chat's terms: input items -> chat messages, a ResponsesRequest -> the
ChatCompletionRequest a replica serves, and a chat answer -> Responses output items.

A Responses request is served as a chat request (the same template, grammars, tool parsers and
sampling), so it gets every check and behaviour chat has; only the shapes differ here.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ValidationError

from deployments.frontend.openai.body import from_validation_error
from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.protocol import ChatCompletionRequest
from deployments.frontend.responses.protocol import ResponsesRequest, TextFormat

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields a Responses request passes to chat as they are.
_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "stop", "ignore_eos", "parallel_tool_calls",
)  # fmt: skip
# Chat fields a replica's refusal names -> the Responses field a client sent.
_PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (`instructions` not included)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        _add_item(out, item, i)
    return out


def _add_item(out: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        out.append({"role": _role(item, i), "content": _content(item.get("content"), i)})
    elif kind == "function_call":
        call = {"id": _str(item, "call_id", i), "type": "function"}
        call["function"] = {"name": _str(item, "name", i), "arguments": _str(item, "arguments", i)}
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, i, "output")
        out.append({"role": "tool", "tool_call_id": _str(item, "call_id", i), "content": text})
    else:
        where = f"input.{i}.type"
        raise APIError(f"{where}: input item of type {kind!r} is not supported", param=where)


def _role(item: dict[str, Any], i: int) -> str:
    role = item.get("role")
    if role not in _ROLES:
        where = f"input.{i}.role"
        raise APIError(f"{where}: must be one of {list(_ROLES)}, got {role!r}", param=where)
    return str(role)


def _str(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        where = f"input.{i}.{key}"
        raise APIError(f"{where}: a string is required", param=where)
    return value


def _text(content: Any, i: int, key: str = "content") -> str:
    """A string, or text parts joined; anything else (images, files) is refused."""
    parts = _content(content, i, key, images=False)
    return parts if isinstance(parts, str) else "".join(p["text"] for p in parts)


def _content(
    content: Any, i: int, key: str = "content", images: bool = True
) -> str | list[dict[str, Any]]:
    """A message's content as chat takes it: a string, or its parts as chat parts (text, and
    `input_image` as `image_url`); a list of text parts only stays one string."""
    if isinstance(content, str):
        return content
    where = f"input.{i}.{key}"
    if not isinstance(content, list):
        raise APIError(f"{where}: a string or a list of content parts is required", param=where)
    parts = [_part(part, f"{where}.{j}", images) for j, part in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _part(part: Any, where: str, images: bool) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "input_image" and images:
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            msg = f"{where}.image_url: a data: or http(s) URL string is required (no file_id)"
            raise APIError(msg, param=f"{where}.image_url")
        detail = part.get("detail")  # NOTE: accepted and ignored, as chat's (docs/vision.md)
        return {
            "type": "image_url",
            "image_url": {"url": url, **({"detail": detail} if detail else {})},
        }
    allowed = "text, input_image" if images else "text only"
    msg = f"{where}: content part of type {kind!r} is not supported ({allowed})"
    raise APIError(msg, param=f"{where}.type")


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request serving `req` over the whole conversation `messages`."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"messages": system + messages, "stream": req.stream}
    body["model"] = req.model  # a LoRA adapter's name, or None (the base)
    for name in _SAMPLING:
        body[name] = getattr(req, name)
    body["max_completion_tokens"] = req.max_output_tokens
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    fmt = req.text_format()
    forced = req.tool_choice not in (None, "auto", "none")
    if fmt is not None and not forced:  # NOTE: a forced call writes no text to format
        body["response_format"] = _response_format(fmt)
    if req.tools:
        body["tools"] = [_chat_tool(t.model_dump(exclude_none=True)) for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        named = {"type": "function", "function": {"name": getattr(choice, "name", "")}}
        body["tool_choice"] = choice if isinstance(choice, str) else named
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # e.g. an input message the chat schema refuses
        raise renamed(from_validation_error(exc)) from None


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    tool.pop("type")
    return {"type": "function", "function": tool}


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.name is None or fmt.schema_ is None:
        msg = "text.format of type 'json_schema' needs `name` and `schema`"
        raise APIError(msg, param="text.format")
    spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    if fmt.description is not None:
        spec["description"] = fmt.description
    return {"type": "json_schema", "json_schema": spec}


def renamed(err: APIError) -> APIError:
    """A chat-side refusal naming the Responses field the client sent."""
    if not err.param:
        return err
    head, _, rest = err.param.partition(".")
    new = _PARAMS.get(head)
    if new is None:
        return err
    param = f"{new}.{rest}" if rest else new
    message = err.message.replace(err.param, param, 1)
    return APIError(message, err.status, err.type, param, err.code, err.headers)


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    item = {"type": "message", "id": item_id, "role": "assistant", "status": status}
    return {**item, "content": content if status == "completed" else []}


def call_item(call: dict[str, Any], item_id: str, status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn.get("arguments") or "",
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its text (if any), then one per call."""
    items = []
    if message.get("content"):
        items.append(message_item(message["content"], new_id("msg")))
    for call in message.get("tool_calls") or ():
        items.append(call_item(call, new_id("fc")))
    return items


def assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the assistant message a later turn's history holds."""
    text = "".join(
        p["text"] for it in items if it["type"] == "message" for p in it.get("content", ())
    )
    calls = [
        {"id": it["call_id"], "type": "function", "function": _fn(it)}
        for it in items
        if it["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _fn(item: dict[str, Any]) -> dict[str, str]:
    return {"name": item["name"], "arguments": item["arguments"]}


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    inp, out = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + out,
    }
