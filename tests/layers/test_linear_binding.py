"""Every linear layer kind of every architecture is bound at build to the method the engine's
choices call for (fp32: our AVX2 kernel or torch's paths; int8: q8), never left on the
default; and a bad shape is refused with the layer named, before any layer is bound."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shortconv.configs.config import ModelConfig
from shortconv.errors import ConfigError
from shortconv.execution.parallel import SINGLE
from shortconv.layers.int4_mix import more_bits, q6_ffn_down
from shortconv.layers.linear import LinearBase, ReplicatedLinear
from shortconv.layers.linear_binding import (
    TORCH_LINEARS,
    LinearPolicy,
    bind_linear_methods,
    linear_layers,
)
from shortconv.layers.linear_cpu_gemm import CpuGemmLinear
from shortconv.layers.linear_float import FLOAT
from shortconv.layers.linear_method import LinearMethod
from shortconv.layers.quantize import Q4Linear, Q6Linear, Q8Linear
from shortconv.layers.vocab import LMHead
from shortconv.models.build import build_model
from shortconv.models.registry import model_class
from shortconv.tiny.checkpoint import make_tiny_checkpoint

# (owning module's class, attribute) of each linear kind, read off the model files; the LM
# head is keyed by its own class (its owner differs per architecture).
HEAD = ("LMHead", "lm_head")
CONV = {("ShortConv", "in_proj"), ("ShortConv", "out_proj")}
ATTENTION = {("Lfm2Attention", p) for p in ("q_proj", "k_proj", "v_proj", "out_proj")}
MLP = {("SwiGLU", w) for w in ("w1", "w2", "w3")}
LFM2 = CONV | ATTENTION | MLP | {HEAD}
LFM3 = LFM2 | {("Lfm2Attention", "g_proj")}  # the per-head output gate
ZAYA1 = {
    *(("CCAProjection", p) for p in ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")),
    ("CCAAttention", "o_proj"),
    ("ZayaRouter", "down_proj"),
    *(("ZayaRouterMLP", p) for p in ("fc1", "fc2", "out_proj")),
    HEAD,
}
KINDS = {
    "lfm2": LFM2,
    "lfm2_moe": LFM2,  # routed experts are fused tensors, not linear layers (not bound yet)
    "lfm3": LFM3,
    "zaya1": ZAYA1,
    "lfm2_vl": LFM2,  # the language model's; the vision tower has its own layers
    "lfm3_vl": LFM3,
}
VISION = {"lfm2_vl", "lfm3_vl"}  # int8/int4 are refused for them at start-up (configs.support)

CPU_GEMM = CpuGemmLinear(FLOAT)  # tiny weights are below oneDNN's size floors
POLICIES: dict[str, tuple[LinearPolicy, LinearMethod, LinearMethod]] = {
    # name: (policy, method of every projection, method of the tied LM head)
    "fp32": (LinearPolicy(cpu_gemm=True), CPU_GEMM, CPU_GEMM),
    "fp32-torch": (TORCH_LINEARS, FLOAT, FLOAT),
    # The quantized head is q8 under int8, q6 under int4; the tied embedding keeps its float rows.
    "int8": (LinearPolicy("int8", cpu_gemm=True), Q8Linear(), Q8Linear(keep_float=True)),
    "int4": (LinearPolicy("int4", cpu_gemm=True), Q4Linear(), Q6Linear(keep_float=True)),
    "int8-float-head": (
        LinearPolicy("int8", quantize_lm_head=False, cpu_gemm=True),
        Q8Linear(),
        CPU_GEMM,
    ),
    "int4-float-head": (
        LinearPolicy("int4", quantize_lm_head=False, cpu_gemm=True),
        Q4Linear(),
        CPU_GEMM,
    ),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelConfig]:
    out = {}
    for arch in KINDS:
        path = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=0)
        out[arch] = ModelConfig.from_dir(path)
    return out


def _kinds(model: nn.Module) -> dict[tuple[str, str], list[LinearBase]]:
    owners = {id(child): type(mod).__name__ for mod in model.modules() for child in mod.children()}
    out: dict[tuple[str, str], list[LinearBase]] = {}
    for name, layer in linear_layers(model):
        attr = name.rsplit(".", 1)[-1]
        key = HEAD if isinstance(layer, LMHead) else (owners[id(layer)], attr)
        out.setdefault(key, []).append(layer)
    return out


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@pytest.mark.parametrize("arch", sorted(KINDS))
def test_each_layer_kind_is_bound_to_its_method(
    configs: dict[str, ModelConfig], arch: str, policy_name: str
) -> None:
    if arch in VISION and policy_name.startswith("int"):
        pytest.skip("int8 and int4 are refused for vision models at start-up")
    policy, projection, head = POLICIES[policy_name]
    cfg = configs[arch]
    model = build_model(model_class(cfg.arch), cfg, SINGLE, "cpu", torch.float32, policy)
    kinds = _kinds(model)
    assert set(kinds) == KINDS[arch]
    tied = model.get_submodule(_head_name(model)).weight.data_ptr() == _embed_ptr(model)
    assert tied == cfg.tie_word_embeddings
    # Under int4, Q4_K_M's ffn_down layers are q6 (layers.int4_mix), the rest of the body q4.
    names = {id(layer): name for name, layer in linear_layers(model)}
    picked = q6_ffn_down(names.values()) if policy.quantization == "int4" else frozenset()
    for kind, layers in kinds.items():
        want = head if kind == HEAD else projection
        if kind == HEAD and not tied and want in (Q8Linear(keep_float=True), Q6Linear(True)):
            want = type(want)()
        got = {layer.method for layer in layers if names[id(layer)] not in picked}
        if got:
            assert got == {want}, f"{arch} {policy_name}: {kind} bound to {got}, want {want}"
        assert all(layer.method == Q6Linear() for layer in layers if names[id(layer)] in picked)
    if policy.quantization == "int4" and arch in ("lfm2", "lfm3"):
        assert picked, "the rule picks at least the last layer's ffn_down"


def test_q4_k_m_ffn_down_rule_picks_llama_cpps_layers() -> None:
    # llama.cpp's use_more_bits on a 16-layer model (LFM2-350M's Q4_K_M): 0, 1, 4, 7, 10, 13,
    # 14, 15 in Q6_K.
    assert [i for i in range(16) if more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    names = [f"model.layers.{i}.feed_forward.w{j}" for i in range(16) for j in (1, 2, 3)]
    want = {f"model.layers.{i}.feed_forward.w2" for i in (0, 1, 4, 7, 10, 13, 14, 15)}
    assert q6_ffn_down(names) == want


def _head_name(model: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if isinstance(m, LMHead))


def _embed_ptr(model: nn.Module) -> int:
    name = _head_name(model).replace("lm_head", "embed_tokens")
    return model.get_submodule(name).weight.data_ptr()


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.good = ReplicatedLinear(64, 8, False)
        self.odd = ReplicatedLinear(40, 8, False)  # 40 input features: no whole q8 blocks


def test_a_shape_int8_cannot_take_is_refused_by_name_before_any_layer_is_bound() -> None:
    model = _TwoLayers().requires_grad_(False)
    with pytest.raises(ConfigError, match=r"odd has 40"):
        bind_linear_methods(model, LinearPolicy("int8"))
    assert model.good.method is FLOAT and model.odd.method is FLOAT


def test_binding_reports_how_many_layers_took_each_method() -> None:
    model = _TwoLayers().requires_grad_(False)
    assert bind_linear_methods(model, LinearPolicy(cpu_gemm=True)) == {"cpu_gemm": 2}
    assert model.good.method == CPU_GEMM


def test_unbound_path_is_the_plain_float_method() -> None:
    """The default a layer holds before build binds it: what the test above must not see."""
    assert ReplicatedLinear(64, 8, False).method is FLOAT
