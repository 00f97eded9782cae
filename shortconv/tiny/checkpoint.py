"""Write small random checkpoints (LFM2, LFM2-MoE, LFM3, ZAYA1) that transformers can load.

    python -m shortconv.tiny.checkpoint --arch {lfm2,lfm2_moe,lfm3,zaya1,lfm2_vl,lfm3_vl} --out DIR
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
from pathlib import Path
from typing import Any

import torch

from shortconv.engine import tokenizer as toks
from shortconv.tiny.presets import TINY_PRESETS, TOKEN_IDS
from shortconv.tiny.rerandomize import rerandomize_, set_skip_bias_
from shortconv.tiny.templates import TEMPLATES

ARCH_MODEL_TYPES: dict[str, str] = {
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "lfm3": "lfm3",
    "zaya1": "zaya",
}
_ARCH_ALIASES = {"zaya": "zaya1"}
# NOTE: re-exported: tests and benchmarks import these names from here.
_TOKEN_IDS = TOKEN_IDS


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
    `lfm2_vl` and `lfm3_vl` are built by shortconv.tiny.vision and shortconv.tiny.lfm3_vl
    (weights and processor; always a tokenizer)."""
    if arch == "lfm2_vl":
        from shortconv.tiny.vision import make_tiny_lfm2_vl

        return make_tiny_lfm2_vl(out_dir, overrides, seed)
    if arch == "lfm3_vl":
        from shortconv.tiny.lfm3_vl import make_tiny_lfm3_vl

        return make_tiny_lfm3_vl(out_dir, overrides, seed)
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
    p.add_argument(
        "--arch", required=True, choices=sorted(TINY_PRESETS) + ["zaya", "lfm2_vl", "lfm3_vl"]
    )
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
