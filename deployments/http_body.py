"""Reading a request body under a size limit (shared by the ingress and LLMServer's app; no
torch, so the ingress process never imports the engine)."""

from __future__ import annotations

from fastapi import Request


class BodyTooLarge(Exception):
    """The body exceeds the limit; each caller answers its own OpenAI-shaped 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
        self.limit = limit


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it is known to exceed `limit`: from Content-Length before
    anything is read, else while streaming, so an oversized body is never buffered."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(limit)
    return bytes(body)
