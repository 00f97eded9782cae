"""Random PEFT LoRA adapters on the tiny transformers models: the tests' oracle side.

PEFT initialises B to zero (an adapter that changes nothing), so A and B are re-randomised
here, each adapter from its own seed, large enough to change the greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from shortconv.tiny.checkpoint import build_hf_model

# Every projection PEFT can target in transformers' implementation of each architecture
# (LFM2-MoE's routed experts are fused parameters, not modules: w1/w2/w3 are its dense layers').
TARGETS = {
    "lfm2": ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "w1", "w2", "w3"],
    "lfm2_moe": ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "w1", "w2", "w3"],
    "lfm3": [
        "in_proj",
        "out_proj",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "g_proj",
        "w1",
        "w2",
        "w3",
    ],
    "zaya1": ["q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj"],
}
# PEFT's `target_parameters` on the fused routed experts (LFM2-MoE, ZAYA1): [E, out, in] each.
EXPERT_PARAMS = ["experts.gate_up_proj", "experts.down_proj"]


def make_adapter(
    arch: str,
    out_dir: Path,
    seed: int,
    rank: int = 4,
    targets: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    use_rslora: bool = False,
    std: float = 0.3,
    params: list[str] | None = None,
) -> torch.nn.Module:
    """Save an adapter on the tiny `arch` base (seed 0) to `out_dir`; returns the PEFT model
    (base + adapter, eval mode): the oracle for this adapter. `params`: PEFT's
    `target_parameters` (then `targets` may be [] for an experts-only adapter)."""
    base = build_hf_model(arch, overrides, seed=0)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=TARGETS[arch] if targets is None else targets,
        target_parameters=params,
        lora_dropout=0.0,
        use_rslora=use_rslora,
    )
    return save_random_adapter(get_peft_model(base, cfg), out_dir, seed, std)


def save_random_adapter(
    model: torch.nn.Module, out_dir: Path, seed: int, std: float = 0.3
) -> torch.nn.Module:
    """Re-randomise a PEFT model's A and B (from `seed`), save the adapter to `out_dir`;
    returns the model in eval mode."""
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out_dir))  # type: ignore[operator]
    return model.eval()
