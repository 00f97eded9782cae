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
from shortconv.configs.config import ModelConfig
from shortconv.configs.support import check_support
from shortconv.errors import CheckpointError, ConfigError
from shortconv.execution.parallel import ParallelContext
from shortconv.models.loader import iter_checkpoint
from shortconv.models.zaya1 import ZayaForCausalLM
from shortconv.tiny.checkpoint import build_hf_model

ROOT = Path(__file__).resolve().parents[2]
CONVERTER = "convert_zaya_weights_to_hf.py"


@pytest.fixture(scope="module")
def cli_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zaya_cli")
    subprocess.run(
        [sys.executable, "-m", "shortconv.tiny.checkpoint", "--arch", "zaya1", "--out", str(out)],
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


def test_tp_sizes_that_cannot_split_heads_are_refused(cli_ckpt: Path) -> None:
    cpu = torch.device("cpu")
    cfg = ModelConfig.from_dir(cli_ckpt)  # 4 heads, 2 KV heads
    for tp in (1, 2, 4):  # 2: one KV head per rank; 4: each KV head on two ranks
        check_support(cfg, cpu, tp)
    for tp in (3, 8):
        with pytest.raises(ConfigError, match=r"does not divide attention heads \(num_attention"):
            check_support(cfg, cpu, tp)
    odd = ModelConfig.from_hf_dict(_raw(cli_ckpt, num_attention_heads=6, num_key_value_heads=3))
    with pytest.raises(ConfigError, match=r"tp_size=2 does not divide KV heads \(num_key_value"):
        check_support(odd, cpu, 2)  # rank 0's query heads 0-2 would need KV heads 0 and 1


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_rank_shards_follow_the_heads_attention_sees(tmp_path: Path, tp: int) -> None:
    """8 query / 2 KV heads: rank r attends with query heads [r*8/tp, (r+1)*8/tp) and the KV
    head they use, j // 4 (head 0: current-token values, head 1: previous-token values). Its
    q_proj also holds the rest of that KV head's group when the KV head is replicated (tp > 2):
    the key residual averages over the whole group."""
    hq, hk, d, hidden = 8, 2, 8, 64
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
    proj = full.qkv_proj

    def heads(w: torch.Tensor, idx: list[int]) -> torch.Tensor:
        return w.view(-1, d, *w.shape[1:])[idx].reshape(-1, *w.shape[1:])

    for rank in range(tp):
        own = list(range(rank * hq // tp, (rank + 1) * hq // tp))
        kv = own[0] // (hq // hk)
        group = list(range(kv * 4, kv * 4 + 4))
        model = ZayaForCausalLM(cfg, ParallelContext(rank=rank, size=tp))
        model.load_weights(iter_checkpoint(tmp_path))
        ours = model.layers[1].self_attn
        torch.testing.assert_close(ours.qkv_proj.q_proj.weight, heads(proj.q_proj.weight, group))
        torch.testing.assert_close(ours.qkv_proj.k_proj.weight, heads(proj.k_proj.weight, [kv]))
        current, delayed = ours.qkv_proj.v_proj_current, ours.qkv_proj.v_proj_delayed
        if kv == 0:
            torch.testing.assert_close(current.weight, proj.v_proj_current.weight)
            assert delayed.weight.shape == (0, hidden)
        else:
            torch.testing.assert_close(delayed.weight, proj.v_proj_delayed.weight)
            torch.testing.assert_close(delayed.bias, proj.v_proj_delayed.bias)
            assert current.weight.shape == (0, hidden)
        conv = proj.conv_qk_grouped.weight  # q heads then k heads, per head d channels
        torch.testing.assert_close(
            ours.qkv_proj.conv_qk_grouped.weight, heads(conv, own + [hq + kv])
        )
        torch.testing.assert_close(ours.qk_norm.temp, full.qk_norm.temp[[kv]])
        o_cols = full.o_proj.weight.view(hidden, hq, d)[:, own].reshape(hidden, -1)
        torch.testing.assert_close(ours.o_proj.weight, o_cols)
