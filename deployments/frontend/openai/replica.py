"""The typed hop from OpenAIIngress to LLMServer: what each call carries and what it returns.

The ingress parses and checks every HTTP request once, then calls one of these methods on a
replica through its DeploymentHandle (deployments/serve/ingress.py, `HandleReplica`); LLMServer
implements them (deployments/frontend/openai/api.py, `OpenAIReplica`). No HTTP crosses the hop: the
request is a validated pydantic model, the answer a `Reply` (or a stream of them), an error an
`APIError` raised in the replica and answered at the ingress.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from deployments.frontend.openai.loras import LoadLoraRequest, UnloadLoraRequest
    from deployments.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
    from deployments.frontend.openai.tokenize import DetokenizeRequest, TokenizeRequest

REPLICA_HEADER = "x-shortconv-replica"  # the HTTP header naming the replica that answered


@dataclass(frozen=True)
class RequestContext:
    """What the HTTP request said besides its body. SessionAffinityRouter reads
    `prefix_hashes` from the call's `ctx` kwarg (the session id also travels as the handle's
    `session_id` option, which Serve puts in the request metadata)."""

    session_id: str | None = None
    prefix_hashes: tuple[int, ...] = ()
    lora_name: str | None = None  # the LoRA adapter the request is for (the router's too)
    lora_path: str | None = None  # where to load it from if this replica lacks it (or None)


@dataclass(frozen=True)
class Reply:
    """One JSON body (a whole response, or one streamed chunk) and the replica that made it
    (the ingress names it in the `x-shortconv-replica` header)."""

    replica_id: str
    body: dict[str, Any]


class Replica(Protocol):
    """LLMServer's methods, as the ingress calls them. The `*_stream` methods yield one Reply
    per SSE event; they raise before the first one when the request is refused."""

    async def chat(self, request: ChatCompletionRequest, ctx: RequestContext) -> Reply: ...
    def chat_stream(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> AsyncIterator[Reply]: ...
    async def completion(self, request: CompletionRequest, ctx: RequestContext) -> Reply: ...
    def completion_stream(
        self, request: CompletionRequest, ctx: RequestContext
    ) -> AsyncIterator[Reply]: ...
    async def tokenize(self, request: TokenizeRequest) -> Reply: ...
    async def detokenize(self, request: DetokenizeRequest) -> Reply: ...
    async def models(self) -> Reply: ...
    async def health(self) -> Reply: ...
    async def stats(self) -> Reply: ...
    async def reset_prefix_cache(self) -> Reply: ...
    async def load_lora(self, request: LoadLoraRequest, ctx: RequestContext) -> Reply: ...
    async def unload_lora(self, request: UnloadLoraRequest, ctx: RequestContext) -> Reply: ...
