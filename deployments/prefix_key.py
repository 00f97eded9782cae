"""A request's prefix key: a chain of hashes over its leading content in fixed blocks.

The ingress computes it from the parsed JSON body before any tokenizer exists (it runs in a
light process with no model), so it is a key of the *text* that renders first, not of tokens:
  * chat: `tools` (rendered before the messages by chat templates), then every message in
    order, each serialized canonically (sorted keys, no spaces);
  * completions: the prompt (a string or token ids) serialized the same way.
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

BLOCK_CHARS = 128
MAX_BLOCKS = 32
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_text(path: str, body: Any) -> str | None:
    """The leading content of a generation request as one string; None when there is none."""
    if not isinstance(body, dict):
        return None
    if path.endswith(CHAT_PATH):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        parts = [_dumps(body["tools"])] if body.get("tools") else []
        return "\n".join(parts + [_dumps(m) for m in messages])
    if path.endswith(COMPLETIONS_PATH):
        prompt = body.get("prompt")
        return _dumps(prompt) if isinstance(prompt, (str, list)) and prompt else None
    return None


def chain_hashes(
    text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> list[int]:
    """Hash i (a 63-bit int: compact, and one JSON/pickle number) covers text[: (i+1)*block];
    the last may cover a partial block."""
    out: list[int] = []
    prev = b""
    for i in range(min(-(-len(text) // block_chars), max_blocks)):
        block = text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        prev = hashlib.blake2b(prev + block, digest_size=8).digest()
        out.append(int.from_bytes(prev, "big") >> 1)
    return out


def prefix_hashes(method: str, path: str, body: bytes) -> list[int]:
    """The prefix key of a raw HTTP request; [] for anything that is not a parseable
    generation request (LLMServer then answers it, errors included)."""
    if method != "POST" or not body:
        return []
    try:
        text = canonical_text(path, json.loads(body))
    except (ValueError, RecursionError):  # malformed or absurdly nested: LLMServer says why
        return []
    return chain_hashes(text) if text else []
