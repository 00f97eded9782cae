"""A chat message's content parts (pydantic, validated at the HTTP edge): text and `image_url`
parts, and the one reading of a part that the text and multimodal paths share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.frontend.openai.errors import APIError

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ImageURL(BaseModel):
    """An `image_url` part's object. `detail` is accepted and ignored: the checkpoint's own
    processor decides an image's resolution (LFM2-VL and LFM3-VL have no low/high mode)."""

    model_config = _STRICT
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


@dataclass(frozen=True)
class ImageRef:
    """One image of a chat request: its URL and the request field a refusal names."""

    url: str
    param: str


def content_part(index: int, j: int, part: ContentPart) -> dict[str, str]:
    """Part `j` of message `index`: a text part as `{"type": "text", "text"}`, an image part as
    `{"url"}`; anything else is a 400 naming the part."""
    where = f"messages.{index}.content.{j}"
    if part.type == "text" and part.text is not None:
        return {"type": "text", "text": part.text}
    if part.type == "image_url":
        if part.image_url is None:
            raise APIError(f"{where}.image_url: required", param=f"{where}.image_url")
        return {"url": part.image_url.url}
    msg = f"{where}: content part of type {part.type!r} is not supported (text, image_url)"
    raise APIError(msg, param=f"{where}.type")
