"""A request's prefix key: a chain of hashes over its leading content in fixed blocks.

The ingress computes it from the validated request before any tokenizer exists (it runs in a
light process with no model), so it is a key of the *text* that renders first, not of tokens:
  * chat: `tools` (rendered before the messages by chat templates), then every message in
    order, each serialized canonically (sorted keys, no spaces);
  * completions: the prompt (a string or token ids) serialized the same way;
  * a request for a LoRA adapter (`model` set: the ingress clears the base model's own name)
    starts with the adapter's name, so no key is shared across adapters, nor with the base:
    their cached states differ (docs/lora.md).
That string is cut into BLOCK_CHARS blocks and hash i covers blocks 0..i (each hash folds in
the previous one), so two requests share hash i exactly when their first i+1 blocks are equal,
and a replica that reports hash i has seen a request with that whole prefix. A partial last
block counts too (its hash matches only the same whole text: a retried or re-sent prompt, or a
short one, follows its first copy). At most MAX_BLOCKS are kept: the first few KiB decide
where a prompt's cached pages are; the key stays a few hundred bytes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from deployments.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest

BLOCK_CHARS = 128
MAX_BLOCKS = 32


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def chat_prefix(request: ChatCompletionRequest) -> tuple[int, ...]:
    tools = (
        [_dumps([t.model_dump(exclude_none=True) for t in request.tools])] if request.tools else []
    )
    messages = [_dumps(m.model_dump(exclude_none=True)) for m in request.messages]
    return chain_hashes(_adapter(request) + "\n".join(tools + messages))


def completion_prefix(request: CompletionRequest) -> tuple[int, ...]:
    return chain_hashes(_adapter(request) + _dumps(request.prompt))


def _adapter(request: ChatCompletionRequest | CompletionRequest) -> str:
    return "" if request.model is None else f"lora:{_dumps(request.model)}\n"


def chain_hashes(
    text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> tuple[int, ...]:
    """Hash i (a 63-bit int: compact, and one JSON/pickle number) covers text[: (i+1)*block];
    the last may cover a partial block."""
    out: list[int] = []
    prev = b""
    for i in range(min(-(-len(text) // block_chars), max_blocks)):
        block = text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        prev = hashlib.blake2b(prev + block, digest_size=8).digest()
        out.append(int.from_bytes(prev, "big") >> 1)
    return tuple(out)
