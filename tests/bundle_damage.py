"""Bundles damaged on purpose, for the oracles that must catch them."""

from __future__ import annotations

import torch

from shortconv.cache.state_bundle import StateBundle, decode, encode


def shifted(bundle: bytes) -> bytes:
    """The bundle with layer 0's conv window moved back one token (its last column dropped):
    well-formed, so only an output oracle can tell."""
    b = decode(bundle)
    tensors = dict(b.tensors)
    conv = tensors["conv"].clone()
    conv[0] = torch.cat([torch.zeros_like(conv[0][..., :1]), conv[0][..., :-1]], dim=-1)
    tensors["conv"] = conv
    return encode(StateBundle(b.layout, b.token_ids, b.checkpoints, tensors))
