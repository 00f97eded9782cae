"""shortconv.tiny.random_stack: built in the target dtype, inference-only, seeded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shortconv.configs.config import EngineConfig
from shortconv.models.build import default_dtype
from shortconv.tiny import random_stack as rs

TINY: dict[str, Any] = {
    **rs.LFM2_350M,
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "full_attn_idxs": [1],
    "block_ff_dim": 128,
    "block_auto_adjust_ff_dim": False,
    "max_position_embeddings": 256,
}
ENG = EngineConfig(max_num_seqs=2, kv_page_size=4)


def _build(dtype: torch.dtype, seed: int = 0) -> rs.RandomStack:
    return rs.build_random_stack(TINY, "cpu", dtype, ENG, num_slots=3, num_pages=9, seed=seed)


def test_weights_are_allocated_in_the_target_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the moment of the final cast, (almost) every weight already has the target dtype:
    only explicitly-fp32 tensors (rotary tables, router biases) are left to convert."""
    seen: list[tuple[torch.dtype, int]] = []
    real_to = nn.Module.to

    def spy(self: nn.Module, *args: Any, **kw: Any) -> nn.Module:
        if not seen:
            seen.extend((t.dtype, t.numel()) for t in (*self.parameters(), *self.buffers()))
        return real_to(self, *args, **kw)

    monkeypatch.setattr(nn.Module, "to", spy)
    stack = _build(torch.bfloat16)
    total = sum(n for _, n in seen)
    fp32 = sum(n for d, n in seen if d == torch.float32)
    assert total and fp32 / total < 0.2, (fp32, total)
    assert {p.dtype for p in stack.model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored


def test_default_dtype_is_restored_on_error() -> None:
    with pytest.raises(RuntimeError), default_dtype(torch.bfloat16):
        assert torch.empty(1).dtype == torch.bfloat16
        raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32


def test_logits_of_an_inference_tensor_outside_inference_mode() -> None:
    """The GPU graph test computes logits of hidden states produced under inference_mode."""
    stack = _build(torch.float32)
    assert not any(p.requires_grad for p in stack.model.parameters())
    with torch.inference_mode():
        hidden = torch.randn(3, TINY["hidden_size"])
    logits = stack.model.compute_logits(hidden)
    assert logits.shape == (3, TINY["vocab_size"])


def test_same_seed_same_weights() -> None:
    a, b = _build(torch.float32, seed=4), _build(torch.float32, seed=4)
    c = _build(torch.float32, seed=5)
    pa, pb, pc = (dict(s.model.named_parameters()) for s in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)
