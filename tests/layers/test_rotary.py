"""RoPE against transformers' LFM3 rotary embedding and rotation: the proportional kind (full
attention: a full-head rotation with zero frequencies past the rotated part) and the default
kind (sliding attention), in fp32 and with bf16 q/k rotated in fp32."""

from __future__ import annotations

import pytest
import torch

from shortconv.configs.config import ModelConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.layers.rotary import RotaryEmbedding, inv_freq_of

pytestmark = pytest.mark.skipif(
    transformers_lacks("lfm3") is not None, reason=str(transformers_lacks("lfm3"))
)
HEAD_DIM = 32
KINDS = {"full_attention": "attention", "sliding_attention": "sliding_attention"}


def _configs(factor: float) -> tuple[object, ModelConfig]:
    from transformers import Lfm3Config

    raw = {
        "model_type": "lfm3",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": 1e6,
                "partial_rotary_factor": factor,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        "layer_types": ["conv", "full_attention", "conv", "sliding_attention"],
    }
    return Lfm3Config.from_dict(dict(raw)), ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("factor", [0.5, 0.25, 1.0])
@pytest.mark.parametrize("label", sorted(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matches_transformers(factor: float, label: str, dtype: torch.dtype) -> None:
    from transformers.models.lfm3.modeling_lfm3 import Lfm3RotaryEmbedding, apply_rotary_pos_emb

    hf_cfg, cfg = _configs(factor)
    hf_rope = Lfm3RotaryEmbedding(hf_cfg)
    spec = cfg.rope_of(KINDS[label])
    assert torch.equal(inv_freq_of(HEAD_DIM, spec), getattr(hf_rope, f"{label}_inv_freq"))

    ours = RotaryEmbedding.of(HEAD_DIM, spec, 4096, fp32=True).to(dtype)
    assert ours.cos.dtype == torch.float32  # the model's dtype cast leaves the tables fp32
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 255, 256, 3000, 4095])
    q = torch.randn(len(positions), 2, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(len(positions), 1, HEAD_DIM, generator=gen).to(dtype)
    cos, sin = hf_rope(q, positions[None], layer_type=label)
    # transformers: [B, H, T, d] with cos/sin [B, T, d]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(positions, q, k)
    assert torch.equal(got_q, ref_q[0].transpose(0, 1))
    assert torch.equal(got_k, ref_k[0].transpose(0, 1))


def test_proportional_rope_leaves_the_unrotated_pairs_alone() -> None:
    """factor 0.5: pairs (i, i + d/2) for i >= d/4 keep their values at every position."""
    _, cfg = _configs(0.5)
    rope = RotaryEmbedding.of(HEAD_DIM, cfg.rope_of("attention"), 64, fp32=True)
    x = torch.randn(5, 1, HEAD_DIM)
    q, _ = rope(torch.arange(5) * 10, x, x)
    quarter, half = HEAD_DIM // 4, HEAD_DIM // 2
    kept = torch.cat([torch.arange(quarter, half), torch.arange(half + quarter, HEAD_DIM)])
    assert torch.equal(q[..., kept], x[..., kept])
    assert not torch.allclose(q[1:, :, :quarter], x[1:, :, :quarter])
