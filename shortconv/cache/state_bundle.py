"""A session's kept state as one value: a versioned, checksummed byte bundle (pure encode/decode).

Layout: `MAGIC`, a little-endian u32 format version, a u32 header length, the header (UTF-8
JSON: the model fingerprint, dtype, TP layout, the key token ids the state covers, one record
per checkpoint and one per tensor: name, dtype, shape, byte length), the tensors' raw bytes in
header order, and a SHA-256 over everything before it. The checksum is checked before anything
else is read, so a flipped byte or a truncated file is refused as a whole, never half-parsed.

A bundle holds every checkpoint a session pins (a chat turn pins two: its prompt's end and its
last token), each covering a prefix of `token_ids`. Why all of them: the next chat turn,
re-rendered by the template, often diverges inside the previous answer and can only resume
from the prompt's end. They share KV pages, so pages are stored once and each checkpoint lists
the ones it reads.

Tensors are in the unsharded (tp_size 1) layout whatever the exporter's TP degree: the executor
gathers the ranks' shards on export and cuts them back out on import (`execution.state_shards`).

Tensor names: a state kind's name (`conv`, ZAYA1's `prev_hs`, ...) is `[n_layers,
n_checkpoints, *shape]`, one slot per checkpoint in header order; `kv{g}.k` / `kv{g}.v` are KV
group g's distinct pages, `[n_layers, n_pages * page_size, Hk, d]`. Checkpoint c reads logical
pages `first_page[g]` .. from `pages[g]` (indices into those distinct pages; group 0 from page
0, a sliding group only its window before the checkpoint: `window_pages.window_span`).

Why JSON + raw bytes rather than torch.save/pickle: a bundle comes from a file or another
replica, and decoding one must never run code; the header is small and the bytes are exact.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"SCSTATE\0"
FORMAT_VERSION = 2  # 2: every pinned checkpoint, pages stored once
_PREFIX = struct.Struct("<II")  # version, header length
_DIGEST = 32  # sha256


class BundleError(ValueError):
    """A bundle that cannot be used; `reason` is a short counter label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class BundleLayout:
    """What must match between the engine that exported a bundle and the one importing it."""

    fingerprint: str  # model identity (`engine.model_fingerprint`)
    dtype: str  # e.g. "torch.bfloat16"
    tp_size: int  # the exporter's degree (for the record: tensors are always unsharded)
    page_size: int


@dataclass(frozen=True)
class BundleCheckpoint:
    """The state after the first `num_tokens` key tokens: per KV group g, logical pages
    `first_page[g]` .. read the bundle's distinct pages `pages[g]` (indices, in order)."""

    num_tokens: int
    first_page: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class StateBundle:
    """One session's kept state: its checkpoints over one key stream (shallowest first)."""

    layout: BundleLayout
    token_ids: tuple[int, ...]  # the key stream the state covers (images as their digests)
    checkpoints: tuple[BundleCheckpoint, ...]
    tensors: dict[str, torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def encode(bundle: StateBundle) -> bytes:
    records: list[dict[str, object]] = []
    blobs: list[bytes] = []
    for name, t in bundle.tensors.items():
        raw = _tensor_bytes(t)
        records.append(
            {"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "nbytes": len(raw)}
        )
        blobs.append(raw)
    lay = bundle.layout
    header = {
        "fingerprint": lay.fingerprint,
        "dtype": lay.dtype,
        "tp_size": lay.tp_size,
        "page_size": lay.page_size,
        "token_ids": list(bundle.token_ids),
        "checkpoints": [
            {"num_tokens": c.num_tokens, "first_page": list(c.first_page), "pages": c.pages}
            for c in bundle.checkpoints
        ],
        "tensors": records,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([MAGIC, _PREFIX.pack(FORMAT_VERSION, len(head)), head, *blobs])
    return body + hashlib.sha256(body).digest()


def decode(data: bytes) -> StateBundle:
    """The bundle in `data`, or BundleError (reason: truncated, checksum, version, format)."""
    fixed = len(MAGIC) + _PREFIX.size
    if len(data) < fixed + _DIGEST:
        raise BundleError("truncated", f"{len(data)} bytes is shorter than any bundle")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise BundleError("checksum", "the SHA-256 over the bundle does not match")
    if body[: len(MAGIC)] != MAGIC:
        raise BundleError("format", "not a state bundle (bad magic)")
    version, head_len = _PREFIX.unpack_from(body, len(MAGIC))
    if version != FORMAT_VERSION:
        raise BundleError(
            "version", f"format version {version}, this engine reads {FORMAT_VERSION}"
        )
    try:
        header = json.loads(body[fixed : fixed + head_len])
        layout = BundleLayout(
            str(header["fingerprint"]),
            str(header["dtype"]),
            int(header["tp_size"]),
            int(header["page_size"]),
        )
        tensors = _tensors(header["tensors"], body, fixed + head_len)
        checkpoints = tuple(_checkpoint(c) for c in header["checkpoints"])
        return StateBundle(layout, tuple(int(t) for t in header["token_ids"]), checkpoints, tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError("format", f"unreadable header: {exc}") from exc


def _checkpoint(rec: dict) -> BundleCheckpoint:
    return BundleCheckpoint(
        int(rec["num_tokens"]),
        tuple(int(p) for p in rec["first_page"]),
        tuple(tuple(int(i) for i in g) for g in rec["pages"]),
    )


def _tensors(records: list[dict], body: bytes, offset: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for rec in records:
        n = int(rec["nbytes"])
        if offset + n > len(body):
            raise BundleError("format", f"tensor {rec['name']} runs past the bundle's end")
        dtype = getattr(torch, str(rec["dtype"]).removeprefix("torch."))
        if not isinstance(dtype, torch.dtype):
            raise BundleError("format", f"tensor {rec['name']}: unknown dtype {rec['dtype']}")
        raw = torch.frombuffer(
            bytearray(body[offset : offset + n]) or bytearray(1), dtype=torch.uint8
        )[:n]
        out[str(rec["name"])] = raw.view(dtype).reshape([int(d) for d in rec["shape"]])
        offset += n
    if offset != len(body):
        raise BundleError("format", f"{len(body) - offset} bytes after the last tensor")
    return out


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return np.asarray(flat.numpy()).tobytes()
