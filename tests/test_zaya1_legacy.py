"""ZAYA1 loading: make_tiny's CLI checkpoint in both engines, the legacy Zyphra layout refused
with the converter's name, config refusals, tp_size refusals and the TP head-block layout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from oracle import assert_matches_oracle, oracle_greedy
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from shortconv import LLM, SamplingParams
from shortconv.config import ConfigError, ModelConfig
from shortconv.loader import iter_checkpoint
from shortconv.models.weights import CheckpointError
from shortconv.models.zaya1 import ZayaForCausalLM
from shortconv.parallel import ParallelContext
from shortconv.support import check_support
from shortconv.tools.make_tiny import build_hf_model

ROOT = Path(__file__).resolve().parent.parent
CONVERTER = "convert_zaya_weights_to_hf.py"


@pytest.fixture(scope="module")
def cli_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zaya_cli")
    subprocess.run(
        [sys.executable, "-m", "shortconv.tools.make_tiny", "--arch", "zaya1", "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return out


def test_make_tiny_cli_checkpoint_loads_in_both(cli_ckpt: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(str(cli_ckpt)).eval()
    llm = LLM(cli_ckpt, dtype="float32")
    prompts = [[5, 9, 13, 200, 77], [42]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_oracle(out.token_ids, oracle_greedy(hf, prompt, 6), f"cli len={len(prompt)}")
    text = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(text[0].token_ids) == 3


def _legacy_dir(cli_ckpt: Path, tmp_path: Path) -> Path:
    shutil.copy(cli_ckpt / "config.json", tmp_path / "config.json")
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.input_norm.weight",
        "model.layers.0.res_scale.residual_scale",
        "model.layers.0.self_attn.qkv.linear_q.weight",
        "model.layers.0.self_attn.qkv.conv_qk.0.weight",
        "model.layers.1.zaya_block.router.down_proj.weight",
        "model.layers.1.zaya_block.experts.local_experts.0.linear_fc1.weight",
    ]
    save_file({n: torch.zeros(4, 4) for n in names}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_legacy_checkpoint_refused_with_converter_name(cli_ckpt: Path, tmp_path: Path) -> None:
    path = _legacy_dir(cli_ckpt, tmp_path)
    with pytest.raises(CheckpointError, match=CONVERTER) as info:
        LLM(path, dtype="float32")
    assert "original Zyphra ZAYA layout" in str(info.value)


def test_legacy_keys_refused_before_any_legacy_tensor_is_loaded(cli_ckpt: Path) -> None:
    model = ZayaForCausalLM(ModelConfig.from_dir(cli_ckpt), ParallelContext())
    consumed: list[str] = []

    names = ["model.embed_tokens.weight", "model.layers.0.input_norm.weight", "model.norm.weight"]

    def stream():
        for name in names:
            consumed.append(name)
            yield name, torch.zeros(3)  # wrong shapes: loading any of them would fail

    with pytest.raises(CheckpointError, match=CONVERTER):
        model.load_weights(stream())
    assert consumed == names[:2]


def _raw(cli_ckpt: Path, **changes: object) -> dict:
    raw = json.loads((cli_ckpt / "config.json").read_text())
    raw.update(changes)
    return raw


def test_legacy_config_refused(cli_ckpt: Path) -> None:
    with pytest.raises(ConfigError, match=CONVERTER):
        ModelConfig.from_hf_dict(_raw(cli_ckpt, zaya_use_eda=True, ffn_hidden_size=128))


def test_config_parsing_and_refusals(cli_ckpt: Path) -> None:
    cfg = ModelConfig.from_dir(cli_ckpt)
    assert cfg.arch == "zaya1" and cfg.layer_types == ("cca",) * 3
    assert cfg.conv_layer_ids == cfg.attention_layer_ids == (0, 1, 2)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (16, 8, 5_000_000.0)
    assert (cfg.cca_time0, cfg.cca_time1, cfg.router_hidden_size) == (2, 2, 32)
    specs = {s.name: s.shape for s in ZayaForCausalLM.state_specs(cfg, ParallelContext())}
    assert specs == {"conv": ((4 + 2) * 16, 2), "prev_state": (2 * 16 // 2,)}
    sliding = _raw(cli_ckpt, layer_types=["hybrid", "hybrid_sliding", "hybrid"], sliding_window=8)
    with pytest.raises(ConfigError, match="hybrid_sliding"):
        ModelConfig.from_hf_dict(sliding)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict(_raw(cli_ckpt, num_experts_per_tok=2))
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_hf_dict(_raw(cli_ckpt, hidden_act="mystery"))


def test_tp_sizes_that_split_heads_unevenly_are_refused(cli_ckpt: Path) -> None:
    cpu = torch.device("cpu")
    cfg = ModelConfig.from_dir(cli_ckpt)  # 4 heads, 2 KV heads
    check_support(cfg, cpu, 1)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        check_support(cfg, cpu, 2)  # 2 KV heads cannot give each rank current + previous halves
    with pytest.raises(ConfigError, match="num_attention_heads"):
        check_support(cfg, cpu, 3)
    wide = ModelConfig.from_hf_dict(_raw(cli_ckpt, num_attention_heads=8, num_key_value_heads=4))
    check_support(wide, cpu, 2)


def test_tp_rank_shards_keep_each_heads_channels_together(tmp_path: Path) -> None:
    """Rank r takes KV-head block r of each value half (current, previous), their query heads,
    and the matching q/k/conv channels, temp entries and o_proj columns."""
    hq, hk, d, tp = 8, 4, 8, 2
    hf = build_hf_model(
        "zaya1",
        {
            "num_attention_heads": hq,
            "num_key_value_heads": hk,
            "head_dim": d,
            "attention_bias": True,
        },
        seed=2,
    )
    hf.save_pretrained(str(tmp_path))
    cfg = ModelConfig.from_dir(tmp_path)
    full = hf.model.layers[1].self_attn
    groups, m = hq // hk, hk // (2 * tp)
    for rank in range(tp):
        model = ZayaForCausalLM(cfg, ParallelContext(rank=rank, size=tp))
        model.load_weights(iter_checkpoint(tmp_path))
        kv = [h for half in (0, hk // 2) for h in range(half + rank * m, half + (rank + 1) * m)]
        qh = [q for h in kv for q in range(h * groups, (h + 1) * groups)]
        ours = model.layers[1].self_attn
        fq = full.qkv_proj.q_proj.weight.view(hq, d, -1)
        fk = full.qkv_proj.k_proj.weight.view(hk, d, -1)
        torch.testing.assert_close(ours.qkv_proj.q_proj.weight, fq[qh].reshape(-1, 64))
        torch.testing.assert_close(ours.qkv_proj.k_proj.weight, fk[kv].reshape(-1, 64))
        fv = torch.cat([full.qkv_proj.v_proj_current.weight, full.qkv_proj.v_proj_delayed.weight])
        ov = torch.cat([ours.qkv_proj.v_proj_current.weight, ours.qkv_proj.v_proj_delayed.weight])
        torch.testing.assert_close(ov, fv.view(hk, d, -1)[kv].reshape(-1, 64))
        rows = [c for h in qh for c in range(h * d, (h + 1) * d)]
        rows += [hq * d + c for h in kv for c in range(h * d, (h + 1) * d)]
        fg = full.qkv_proj.conv_qk_grouped
        torch.testing.assert_close(ours.qkv_proj.conv_qk_grouped.weight, fg.weight[rows])
        torch.testing.assert_close(
            ours.qkv_proj.conv_qk_depthwise.bias, full.qkv_proj.conv_qk_depthwise.bias[rows]
        )
        torch.testing.assert_close(ours.qk_norm.temp, full.qk_norm.temp[kv])
        fo = full.o_proj.weight.view(64, hq, d)
        torch.testing.assert_close(ours.o_proj.weight, fo[:, qh].reshape(64, -1))
