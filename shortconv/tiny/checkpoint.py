"""Write small random checkpoints (LFM2, LFM2-MoE, LFM3, ZAYA1) that transformers can load.

    python -m shortconv.tiny.checkpoint --arch {lfm2,lfm2_moe,lfm3,zaya1,lfm2_vl} --out DIR
        [--seed N] [--set key=value ...] [--skip-bias B] [--no-tokenizer]

Writes config.json, generation_config.json, model.safetensors (fp32) and a byte-level tokenizer
(shortconv.engine.tokenizer) with a ChatML template that carries the family's tool-calling format
(shortconv.tiny.templates), all built locally; a pure function of the inputs.

Re-randomisation (`rerandomize_`): transformers' default init (std 0.02, norms at 1, biases at
0, ZAYA's `temp` at 0) makes logits near-ties and turns whole code paths into identities, so an
engine that forgot a norm weight or a residual scale would still match. So every parameter and
persistent float buffer is redrawn from a seeded generator:
  * matrices/3-D tensors: N(0, 1/fan_in) so activations keep unit scale (fan_in = last dim,
    in_channels/groups * kernel for Conv1d); embeddings (= tied lm_head) use std
    LOGIT_GAIN/sqrt(hidden): logits get a std of about LOGIT_GAIN, so greedy has margins;
  * tensors initialised to all ones (norm weights, ZAYA residual/input scales,
    router_states_scale): 1 + U(-scale, scale);
  * tensors initialised to all zeros (linear/conv biases, ZAYA residual/input biases):
    U(-scale, scale) * BIAS_FRACTION. Kept small because these add the same vector at every
    position: larger values make a few "hub" tokens win greedy decoding almost everywhere;
  * routing biases (LFM2-MoE `expert_bias`, ZAYA `balancing_biases` of the real experts):
    U(-scale, scale) * ROUTING_BIAS_FRACTION, small next to router probabilities so routing
    stays router-driven, yet large enough to flip some expert choices;
  * ZAYA `qk_norm.temp` (zeros at init) multiplies the keys, and near-zero values would make
    attention uniform, so it is treated like a scale: 1 + U(-scale, scale);
  * ZAYA's skip class (last entry of `balancing_biases`) keeps its -1.0, which softmax probs
    (<= 1) can never overcome; raise it with `skip_bias` (kwarg, `--skip-bias` or override key
    `skip_bias`), e.g. 0.0 takes the skip route for roughly the tokens where its prob is top.

KNOWN ORACLE DEFECT (transformers 5.24, verified): `ZayaPreTrainedModel._init_weights` runs
`module.balancing_biases[-1] = -1.0` as a raw assignment, which also executes after
`from_pretrained` loads the weights, so a reloaded HF ZAYA model always has a skip bias of -1.0
whatever the checkpoint says. The checkpoint is the truth: tests that raise the skip bias must
compare against the in-memory model from `build_hf_model`. All other tensors round-trip.

Saved layouts (transformers 5.24 `save_pretrained`, lm_head tied so `lm_head.weight` is absent):
  * lfm2_moe experts are written per expert via the reverse conversion mapping:
    `model.layers.{i}.feed_forward.experts.{e}.w1.weight` [moe_inter, hidden] (gate),
    `...w3.weight` [moe_inter, hidden] (up), `...w2.weight` [hidden, moe_inter] (down);
  * zaya experts stay fused: `model.layers.{i}.mlp.experts.gate_up_proj`
    [experts, 2*moe_inter, hidden] (gate rows first, then up) and `...experts.down_proj`
    [experts, hidden, moe_inter].
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from shortconv.engine import tokenizer as toks
from shortconv.tiny.templates import TEMPLATES

ARCH_MODEL_TYPES: dict[str, str] = {
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "lfm3": "lfm3",
    "zaya1": "zaya",
}
_ARCH_ALIASES = {"zaya": "zaya1"}

_TOKEN_IDS = {
    "pad_token_id": toks.SPECIAL_TOKENS.index(toks.PAD_TOKEN),
    "bos_token_id": toks.SPECIAL_TOKENS.index(toks.BOS_TOKEN),
    "eos_token_id": toks.SPECIAL_TOKENS.index(toks.EOS_TOKEN),
}

TINY_PRESETS: dict[str, dict[str, Any]] = {
    "lfm2": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        # False: with True the MLP width would be rounded up to a multiple of 256.
        "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
        "conv_L_cache": 3,
        "conv_bias": False,
        "tie_word_embeddings": True,
        **_TOKEN_IDS,
    },
    "lfm2_moe": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        # Layer 0 is the dense one; MoE covers both a conv and an attention layer.
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "num_dense_layers": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "use_expert_bias": True,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "conv_L_cache": 3,
        "conv_bias": False,
        "tie_word_embeddings": True,
        **_TOKEN_IDS,
    },
    "lfm3": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        # 16 q / 4 KV heads in the real model: tp 2 and 4 shard the KV heads here too.
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        # Both attention kinds, three conv layers (one between two sliding layers).
        "layer_types": [
            "conv",
            "sliding_attention",
            "conv",
            "full_attention",
            "sliding_attention",
            "conv",
        ],
        # A window of a few KV pages at the tests' page sizes; RoPE, conv width and the gates
        # and sandwich norms take Lfm3Config's defaults.
        "sliding_window": 8,
        "tie_word_embeddings": True,
        **_TOKEN_IDS,
    },
    "zaya1": {  # transformers model_type "zaya", ZayaForCausalLM
        "vocab_size": 512,
        "hidden_size": 64,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 32,
        "router_hidden_size": 32,
        "cca_time0": 2,
        "cca_time1": 2,
        "tie_word_embeddings": True,
        **_TOKEN_IDS,
    },
}

LOGIT_GAIN = 3.0
BIAS_FRACTION = 0.1
ROUTING_BIAS_FRACTION = 0.2
_ROUTING_BIASES = ("expert_bias", "balancing_biases")
_SCALE_LIKE_ZERO_INIT = ("qk_norm.temp",)


def _canonical_arch(arch: str) -> str:
    arch = _ARCH_ALIASES.get(arch, arch)
    if arch not in TINY_PRESETS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(TINY_PRESETS)}")
    return arch


def _config_kwargs(arch: str, overrides: dict[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(TINY_PRESETS[arch])
    overrides = dict(overrides or {})
    layers = overrides.get("num_hidden_layers")
    if layers is not None and "layer_types" not in overrides:
        if arch == "zaya1":
            kwargs.pop("layer_types", None)  # the config fills all-"hybrid"
        else:
            # Keep the preset's conv/attention pattern, repeated or cut to the new depth.
            pattern = kwargs["layer_types"]
            kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(int(layers))]
    kwargs.update(overrides)
    return kwargs


def _fan_in(name: str, t: torch.Tensor) -> int:
    if t.ndim == 3 and "experts" not in name:
        return t.shape[1] * t.shape[2]  # Conv1d: (out, in/groups, kernel)
    return t.shape[-1]  # Linear/Embedding (out, hidden) and fused experts (experts, out, in)


def _uniform(t: torch.Tensor, gen: torch.Generator, low: float, high: float) -> torch.Tensor:
    return torch.rand(t.shape, generator=gen, dtype=torch.float64) * (high - low) + low


def _redraw(name: str, t: torch.Tensor, gen: torch.Generator, scale: float) -> torch.Tensor | None:
    small = scale * BIAS_FRACTION
    if name.endswith(_ROUTING_BIASES):
        bound = scale * ROUTING_BIAS_FRACTION
        new = _uniform(t, gen, -bound, bound).to(t.dtype)
        if name.endswith("balancing_biases"):
            new[-1] = t[-1]  # the skip class keeps its value; see module docstring
        return new
    if t.ndim >= 2:
        gain = LOGIT_GAIN if ("embed_tokens" in name or "lm_head" in name) else 1.0
        std = gain / math.sqrt(_fan_in(name, t))
        return torch.randn(t.shape, generator=gen, dtype=torch.float64) * std
    if bool((t == 1).all()):
        return 1.0 + _uniform(t, gen, -scale, scale)
    if bool((t == 0).all()):
        if any(name.endswith(s) for s in _SCALE_LIKE_ZERO_INIT):
            return 1.0 + _uniform(t, gen, -scale, scale)
        return _uniform(t, gen, -small, small)
    return None  # other 1-D tensors already hold seeded random values


def rerandomize_(model: torch.nn.Module, seed: int, scale: float = 0.5) -> None:
    """Redraw every parameter and persistent float buffer in place (rules: module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: list[tuple[str, torch.Tensor]] = list(model.named_parameters())  # tied: once
    for mod_name, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf_name not in skip and buf is not None and buf.is_floating_point():
                tensors.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, buf))
    with torch.no_grad():
        for name, t in tensors:
            new = _redraw(name, t, gen, scale)
            if new is not None:
                t.copy_(new.to(t.dtype))


def set_skip_bias_(model: torch.nn.Module, skip_bias: float) -> int:
    """Set the ZAYA skip-class bias of every router; returns how many routers were changed."""
    n = 0
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("balancing_biases"):
                buf[-1] = float(skip_bias)
                n += 1
    return n


def build_hf_model(
    arch: str,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    skip_bias: float | None = None,
) -> Any:
    """A re-randomised fp32 transformers model in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    arch = _canonical_arch(arch)
    overrides = dict(overrides or {})
    if "skip_bias" in overrides:
        skip_bias = float(overrides.pop("skip_bias"))
    config = AutoConfig.for_model(ARCH_MODEL_TYPES[arch], **_config_kwargs(arch, overrides))
    # fork_rng: construction draws from the global RNG; seed it without leaking state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rerandomize_(model, seed)
    if skip_bias is not None:
        if set_skip_bias_(model, skip_bias) == 0:
            raise ValueError(f"skip_bias only applies to zaya1, not {arch}")
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model.eval()


def make_tiny_checkpoint(
    arch: str,
    out_dir: str | Path,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    with_tokenizer: bool = True,
    skip_bias: float | None = None,
) -> Path:
    """Build and save model + config + generation_config (+ tokenizer); returns the directory.
    `lfm2_vl` is built by shortconv.tiny.vision (weights and processor; always a tokenizer)."""
    if arch == "lfm2_vl":
        from shortconv.tiny.vision import make_tiny_lfm2_vl

        return make_tiny_lfm2_vl(out_dir, overrides, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_hf_model(arch, overrides, seed=seed, skip_bias=skip_bias)
    model.save_pretrained(str(out))
    if with_tokenizer:
        cfg = model.config
        template, named = TEMPLATES[_canonical_arch(arch)]
        tok = toks.build_byte_tokenizer(
            cfg.vocab_size,
            model_max_length=cfg.max_position_embeddings,
            chat_template=template,
            named_special=named,
        )
        tok.save_pretrained(str(out))
    return out


def _parse_set(items: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        try:
            overrides[key] = json.loads(raw)  # numbers, true/false, lists
        except json.JSONDecodeError:
            overrides[key] = raw  # bare strings
    return overrides


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", required=True, choices=sorted(TINY_PRESETS) + ["zaya", "lfm2_vl"])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--skip-bias", type=float, default=None, help="ZAYA skip-class bias")
    p.add_argument("--no-tokenizer", action="store_true")
    args = p.parse_args(argv)
    out = make_tiny_checkpoint(
        args.arch,
        args.out,
        overrides=_parse_set(args.sets),
        seed=args.seed,
        with_tokenizer=not args.no_tokenizer,
        skip_bias=args.skip_bias,
    )
    print(out)


if __name__ == "__main__":
    main()
