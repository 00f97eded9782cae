"""The limits on a request's images (the YAML `args: images:` block), validated at the edge.

Every image of a chat request is fetched (an http(s) URL) or decoded from its `data:` URL by
the replica (deployments/frontend/images/fetch.py, decode.py), within these limits; breaking one
is a 400 naming the content part (deployments/frontend/openai/images.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Scheme = Literal["data", "http", "https"]  # NOTE: never `file:`: a client must not read our disk


class ImageError(ValueError):
    """A client's image that cannot be used: the message says why."""


class ImageLimits(BaseModel):
    """`max_images`: per request (the whole conversation's); `max_bytes`: one image's encoded
    size (a download or a data URL's decoded bytes); `max_pixels`: one image's width x height,
    read from its header before it is decoded; `fetch_timeout_s`: one URL's whole download,
    redirects included; `max_redirects`: followed per URL, each hop's scheme checked again;
    `schemes`: the URL schemes accepted; `allow_private_networks`: let URLs reach loopback,
    private, link-local and other local addresses (refused by default:
    deployments/frontend/images/hosts.py);
    `allowed_hosts`: if set, the only host names an http(s) URL (and each redirect) may name,
    matched exactly, ignoring case."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_images: int = Field(8, ge=1)
    max_bytes: int = Field(10 << 20, ge=1)
    max_pixels: int = Field(4096 * 4096, ge=1)
    fetch_timeout_s: float = Field(10.0, gt=0)
    max_redirects: int = Field(3, ge=0)
    schemes: tuple[Scheme, ...] = ("data", "http", "https")
    allow_private_networks: bool = False
    allowed_hosts: tuple[str, ...] | None = Field(None, min_length=1)

    @field_validator("allowed_hosts")
    @classmethod
    def _lower_case(cls, hosts: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if hosts is None else tuple(h.strip().lower() for h in hosts)
