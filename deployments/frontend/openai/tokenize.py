"""vLLM's tokenizer routes: /tokenize (a prompt, or chat messages through the chat template)
and /detokenize, with vLLM's request and response shapes. Served by the replica, which holds
the model's tokenizer; the ingress only parses (deployments/serve/ingress.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.protocol import ChatMessage, TokenId
from deployments.frontend.openai.tools import ToolDef

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TokenizeRequest(BaseModel):
    """Either `prompt` (vLLM's TokenizeCompletionRequest) or `messages` (its
    TokenizeChatRequest, rendered with the chat template)."""

    model_config = ConfigDict(**_STRICT, json_schema_extra={"examples": [{"prompt": "Hello"}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    add_generation_prompt: bool = True  # chat only
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("send exactly one of prompt and messages", param="prompt")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict(i) for i, m in enumerate(self.messages or ())]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(**_STRICT, json_schema_extra={"examples": [{"tokens": [1, 2]}]})
    model: str | None = None
    tokens: list[TokenId]


def tokenize_body(
    tokens: list[int], max_model_len: int, token_strs: list[str] | None
) -> dict[str, Any]:
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }


def check_vocab(tokens: list[int], vocab: int) -> None:
    bad = next((t for t in tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
) -> list[int]:
    """The chat template over the messages (and tools): the prompt's token ids."""
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {}),
        )
    except Exception as exc:  # jinja errors: the template refused these messages
        raise APIError(f"chat template failed: {exc}", param="messages") from None


def tokenize(
    tokenizer: Any, req: TokenizeRequest, max_model_len: int, token_text: Any
) -> dict[str, Any]:
    """vLLM's /tokenize answer. `token_text`: one token's text (for `return_token_strs`)."""
    req.check()
    if req.messages is not None:
        if req.add_special_tokens:
            msg = "add_special_tokens must be false with messages: the chat template writes them"
            raise APIError(msg, param="add_special_tokens")
        messages = req.template_messages()
        ids = render_chat(tokenizer, messages, req.add_generation_prompt, req.template_tools())
    else:
        try:
            ids = tokenizer.encode(
                req.prompt, add_special_tokens=req.add_special_tokens is not False
            )
        except Exception as exc:  # a string the tokenizer cannot take is the client's
            raise APIError(f"prompt cannot be tokenized: {exc}", param="prompt") from None
    strs = [token_text(t) for t in ids] if req.return_token_strs else None
    return tokenize_body(list(ids), max_model_len, strs)


def detokenize(tokenizer: Any, req: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's /detokenize answer: the ids' text, special tokens kept."""
    vocab = getattr(tokenizer, "vocab_size", None)
    if isinstance(vocab, int):
        check_vocab(req.tokens, vocab)
    try:
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
    except Exception as exc:
        raise APIError(f"tokens cannot be decoded: {exc}", param="tokens") from None
