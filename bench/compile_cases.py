"""The launch configurations the engine uses for each published model shape, as wrapper calls on
`meta` tensors (for bench/cuda_compile.py's sm_90 compile sweep).

A model shape is one rank of a published checkpoint (tests/published_configs.py) at one
tensor-parallel size: the per-rank widths the layers hand the kernels. A kernel family turns a
rank shape and a dtype into calls of its real wrapper, one per launch configuration the engine
uses: decode batch buckets (`graph_batch_sizes`), the prefill chunk (`max_num_batched_tokens`),
the decode context of the default KV budget and of the model's full length.

To add a kernel: write `def my_kernel(rank: RankShape, dtype, quick) -> Iterator[Launch]` that
yields nothing for ranks without that layer, and add it to `FAMILIES`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

# NOTE: found wherever it sits under tests/ (test files are being sorted into folders).
_CONFIGS = next((Path(__file__).resolve().parents[1] / "tests").rglob("published_configs.py"))
sys.path.insert(0, str(_CONFIGS.parent))
import published_configs as pc  # noqa: E402

META = torch.device("meta")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)  # EngineConfig.graph_batch_sizes
PREFILL_TOKENS = 512  # EngineConfig.max_num_batched_tokens: one prefill chunk
PREFILL_SEQS = 4  # sequences packed into that chunk
MAX_NUM_SEQS = 32
PAGE = 16
KV_BYTES = 1 << 30  # EngineConfig.kv_cache_bytes per rank
H200_SMS = 132


def _lfm3_layer_types(n: int) -> list[str]:
    """LFM3's default layout (transformers' Lfm3Config): full attention at i % 4 == 2, sliding
    at i % 4 == 0 (not layer 0), short conv elsewhere."""
    return [
        "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i else "conv"
        for i in range(n)
    ]


# LiquidAI/LFM3-1.7B: the shape fields of transformers 5.24's Lfm3Config class defaults (its
# documented checkpoint): 24 layers (13 conv of width 7, 6 full and 5 sliding-window
# attention, window 256), 16 query / 4 KV heads of 128. Kept here until tests/published_configs
# lists LFM3.
LFM3_1_7B: dict[str, Any] = {
    "architectures": ["Lfm3ForCausalLM"],
    "model_type": "lfm3",
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 128000,
    "conv_L_cache": 7,
    "sliding_window": 256,
    "layer_types": _lfm3_layer_types(24),
}
MODELS: dict[str, dict[str, Any]] = {
    "LFM2-350M": pc.LFM2_350M,
    "LFM2-1.2B": pc.LFM2_1_2B,
    "LFM2-2.6B": pc.LFM2_2_6B,
    "LFM2-8B-A1B": pc.LFM2_8B_A1B,
    "ZAYA1-8B": pc.ZAYA1_8B,
    "LFM3-1.7B": LFM3_1_7B,
}
# tp sizes each model supports (tests/test_published_shapes.py; LFM2-350M also at 16).
TP_SIZES: dict[str, tuple[int, ...]] = {m: (1, 2, 4, 8) for m in MODELS} | {
    "LFM2-350M": (1, 2, 4, 8, 16)
}


@dataclass(frozen=True)
class RankShape:
    """What one rank's layers hand the kernels. conv_dim 0: no short conv; cca_chans 0: no CCA;
    experts 0: no routed experts; window 0: no sliding-window attention layer."""

    model: str
    tp: int
    hq: int
    hk: int
    head_dim: int
    n_attn: int
    max_len: int
    conv_dim: int = 0
    conv_width: int = 0
    cca_chans: int = 0
    cca_t0: int = 0
    cca_t1: int = 0
    experts: int = 0
    hidden: int = 0
    inter: int = 0
    top_k: int = 0
    window: int = 0

    @property
    def label(self) -> str:
        return f"{self.model} tp{self.tp}"

    def contexts(self) -> tuple[int, ...]:
        """Decode context widths: the default KV budget's per-sequence cap, and full length."""
        page_bytes = 2 * self.n_attn * PAGE * self.hk * self.head_dim * 2  # K and V, bf16
        capped = (KV_BYTES // page_bytes) * PAGE // MAX_NUM_SEQS // PAGE * PAGE
        return tuple(sorted({min(capped, self.max_len), self.max_len}))


def rank_shape(model: str, tp: int) -> RankShape:
    raw = MODELS[model]
    nh, nk, h = raw["num_attention_heads"], raw["num_key_value_heads"], raw["hidden_size"]
    d = raw.get("head_dim", h // nh)
    hq, hk = nh // tp, max(1, nk // tp)
    common = dict(model=model, tp=tp, hq=hq, hk=hk, head_dim=d)
    if raw["model_type"] == "zaya":
        return RankShape(
            **common,
            n_attn=raw["num_hidden_layers"],
            max_len=raw["max_position_embeddings"],
            cca_chans=(hq + hk) * d,  # this rank's query heads and KV heads, raw q‖k
            cca_t0=raw["cca_time0"],
            cca_t1=raw["cca_time1"],
            experts=raw["num_experts"],
            hidden=h,
            inter=raw["moe_intermediate_size"] // tp,
            top_k=raw["num_experts_per_tok"],
        )
    moe = raw["model_type"] == "lfm2_moe"
    kinds = raw["layer_types"]
    sliding = kinds.count("sliding_attention")
    return RankShape(
        **common,
        n_attn=kinds.count("full_attention") + sliding,
        window=raw["sliding_window"] if sliding else 0,
        max_len=raw["max_position_embeddings"],
        conv_dim=h // tp,
        conv_width=raw["conv_L_cache"],
        experts=raw["num_experts"] if moe else 0,
        hidden=h,
        inter=raw["moe_intermediate_size"] // tp if moe else 0,
        top_k=raw["num_experts_per_tok"] if moe else 0,
    )


def rank_shapes(models: tuple[str, ...] = tuple(MODELS)) -> list[RankShape]:
    return [rank_shape(m, tp) for m in models for tp in TP_SIZES[m]]


@dataclass(frozen=True)
class Launch:
    """One wrapper call at one launch configuration."""

    shape: str
    call: Callable[[], object]


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def _varlen(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query_start_loc int32 [B+1], cache_indices int64 [B], has_initial_state bool [B]."""
    return (
        _t(batch + 1, dtype=torch.int32),
        _t(batch, dtype=torch.int64),
        _t(batch, dtype=torch.bool),
    )


def _batches(quick: bool) -> tuple[int, ...]:
    return (DECODE_BATCHES[-1],) if quick else DECODE_BATCHES


def short_conv(rank: RankShape, dtype: torch.dtype, quick: bool) -> Iterator[Launch]:
    from shortconv.kernels import conv1d_triton as k

    if not rank.conv_dim:
        return
    dim, w = rank.conv_dim, rank.conv_width
    weight, states = _t(dim, w, dtype=dtype), _t(MAX_NUM_SEQS + 1, dim, w - 1, dtype=dtype)
    x = _t(PREFILL_TOKENS, dim, dtype=dtype).t()  # token-major, as ShortConv passes it
    varlen = _varlen(PREFILL_SEQS)
    yield Launch(
        f"prefill T={PREFILL_TOKENS}",
        lambda: k.causal_conv1d_fn_triton(x, weight, None, states, *varlen),
    )
    for b in _batches(quick):
        xb, idx = _t(b, dim, dtype=dtype), _t(b, dtype=torch.int64)
        yield Launch(
            f"decode B={b}",
            lambda xb=xb, idx=idx: k.causal_conv1d_update_triton(xb, states, weight, None, idx),
        )


def cca_conv(rank: RankShape, dtype: torch.dtype, quick: bool) -> Iterator[Launch]:
    from shortconv.kernels import cca_triton as k

    if not rank.cca_chans:
        return
    c, g, t0, t1 = rank.cca_chans, rank.head_dim, rank.cca_t0, rank.cca_t1
    w0, b0 = _t(c, t0, dtype=dtype), _t(c, dtype=dtype)
    w1, b1 = _t(c, g, t1, dtype=dtype), _t(c, dtype=dtype)
    states = _t(MAX_NUM_SEQS + 1, c, (t0 - 1) + (t1 - 1), dtype=dtype)
    x = _t(PREFILL_TOKENS, c, dtype=dtype).t()
    varlen = _varlen(PREFILL_SEQS)
    yield Launch(
        f"prefill T={PREFILL_TOKENS}",
        lambda: k.cca_conv_fn_triton(x, w0, b0, w1, b1, states, *varlen),
    )
    for b in _batches(quick):
        xb, idx = _t(b, c, dtype=dtype), _t(b, dtype=torch.int64)
        yield Launch(
            f"decode B={b}",
            lambda xb=xb, idx=idx: k.cca_conv_update_triton(xb, states, w0, b0, w1, b1, idx),
        )


def _kv(rank: RankShape, ctx: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    pages = rows * (ctx // PAGE) + 1
    kc = _t(pages * PAGE, rank.hk, rank.head_dim, dtype=dtype)
    return kc, _t(*kc.shape, dtype=dtype), _t(rows, ctx // PAGE, dtype=torch.int32)


def attention(rank: RankShape, dtype: torch.dtype, quick: bool) -> Iterator[Launch]:
    """Decode and extend launches; a rank with sliding-window layers adds their launches too
    (`window` > 0: the decode splits count only the window's positions)."""
    from shortconv.kernels import attention_triton as k

    hq, hk, d = rank.hq, rank.hk, rank.head_dim
    scale = d**-0.5
    contexts = rank.contexts()[-1:] if quick else rank.contexts()
    windows = (0, rank.window) if rank.window else (0,)
    for ctx in contexts:
        for b in _batches(quick):
            kc, vc, bt = _kv(rank, ctx, b, dtype)
            q, lens = _t(b, hq, d, dtype=dtype), _t(b, dtype=torch.int32)
            for w in windows:
                span = min(ctx, w) if w else ctx
                splits = k.decode_splits(b, hk, span, META, programs=2 * H200_SMS)
                yield Launch(
                    f"decode B={b} ctx={ctx}{f' w={w}' if w else ''} splits={splits}",
                    lambda q=q, kc=kc, vc=vc, bt=bt, lens=lens, s=splits, w=w: (
                        k.paged_attention_decode_triton(
                            q, kc, vc, bt, lens, scale, PAGE, num_splits=s, window=w
                        )
                    ),
                )
    kc, vc, bt = _kv(rank, 2048, PREFILL_SEQS, dtype)
    q, lens = _t(PREFILL_TOKENS, hq, d, dtype=dtype), _t(PREFILL_SEQS, dtype=torch.int32)
    qsl = _t(PREFILL_SEQS + 1, dtype=torch.int32)
    for w in windows:
        yield Launch(
            f"extend T={PREFILL_TOKENS}{f' w={w}' if w else ''}",
            lambda w=w: k.paged_attention_extend_triton(
                q, kc, vc, bt, lens, qsl, scale, PAGE, max_query_len=PREFILL_TOKENS, window=w
            ),
        )


def fused_moe(rank: RankShape, dtype: torch.dtype, quick: bool) -> Iterator[Launch]:
    from shortconv.kernels import moe_triton as k

    if not rank.experts:
        return
    e, h, i, top = rank.experts, rank.hidden, rank.inter, rank.top_k
    gate_up, down = _t(e, 2 * i, h, dtype=dtype), _t(e, h, i, dtype=dtype)
    tokens = (PREFILL_TOKENS,) if quick else (*DECODE_BATCHES, PREFILL_TOKENS)
    for t in tokens:
        x, ids, w = _t(t, h, dtype=dtype), _t(t, top, dtype=torch.int64), _t(t, top)
        yield Launch(
            f"T={t} block_m={k.block_m_for(t * top, e)}",
            lambda x=x, ids=ids, w=w: k.fused_moe_triton(x, gate_up, down, ids, w, "silu"),
        )


LORA_RANKS = (16, 64)  # a typical adapter, and the kernels' largest rank
LORA_SLOTS = 4  # max_loras
# Dense-projection LoRA on the dense models (routed experts: `expert_lora` below);
# LFM2-350M's launches are the ones docs/lora.md reports.
LORA_MODELS = ("LFM2-350M", "LFM2-1.2B", "LFM2-2.6B", "LFM3-1.7B")


def _lora_projections(rank: RankShape) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable projection on this rank, as the layers shard them: the
    short conv's in_proj (B‖C‖x) and out_proj, attention q/k/v/o, and the dense MLP's
    w1/w3 and w2 (LFM2's; column-parallel: out split, row-parallel: in split)."""
    h, qd, kd = rank.hidden, rank.hq * rank.head_dim, rank.hk * rank.head_dim
    proj = {"q": (h, qd), "kv": (h, kd), "o": (qd, h)}
    if rank.conv_dim:
        proj |= {"in_proj": (h, 3 * rank.conv_dim), "out_proj": (rank.conv_dim, h)}
    from shortconv.configs.hf.lfm2 import mlp_size

    raw = MODELS[rank.model]
    if raw["model_type"] == "lfm2":  # LFM3-1.7B's MLP width is not in LFM3_1_7B above
        ff = mlp_size(SimpleNamespace(**raw), "lfm2") // rank.tp
        proj |= {"w1": (h, ff), "w2": (ff, h)}
    return proj


def lora(rank: RankShape, dtype: torch.dtype, quick: bool) -> Iterator[Launch]:
    """Shrink + expand over every adaptable projection, at the decode buckets and the prefill
    chunk, for rank 16 and 64 adapters in LoraSlots' layout (slot-major views of rank-major
    storage, as the engine passes them)."""
    from shortconv.kernels import lora_triton as k

    if rank.model not in LORA_MODELS:
        return
    tokens = (PREFILL_TOKENS,) if quick else (*DECODE_BATCHES, PREFILL_TOKENS)
    for name, (in_f, out_f) in _lora_projections(rank).items():
        for r in LORA_RANKS:
            a = _t(r, LORA_SLOTS, in_f, dtype=dtype).transpose(0, 1)
            b = _t(out_f, r, LORA_SLOTS, dtype=dtype).permute(2, 0, 1)
            for t in tokens:
                x, y, ids = (
                    _t(t, in_f, dtype=dtype),
                    _t(t, out_f, dtype=dtype),
                    _t(t, dtype=torch.int64),
                )
                yield Launch(
                    f"{name} {in_f}->{out_f} r={r} T={t}",
                    lambda x=x, y=y, ids=ids, a=a, b=b, r=r: k.lora_delta_triton(
                        y, x, a, b, ids, r, align=k.align_rows(ids, LORA_SLOTS)
                    ),
                )


def expert_lora(rank: RankShape, dtype: torch.dtype, quick: bool) -> Iterator[Launch]:
    """The fused MoE with LoRA on its experts (the MoE kernels' HAS_DELTA variants and the
    shrink/expand over E * max_loras flat slots), rank 16 and 64, in ExpertLoraSlots' flat
    layout, at the decode buckets and the prefill chunk."""
    from shortconv.kernels import moe_lora_triton as k
    from shortconv.kernels.moe_lora_ref import ExpertLoraRows

    if not rank.experts:
        return
    e, h, i, top = rank.experts, rank.hidden, rank.inter, rank.top_k
    gate_up, down = _t(e, 2 * i, h, dtype=dtype), _t(e, h, i, dtype=dtype)
    flat = e * LORA_SLOTS
    tokens = (PREFILL_TOKENS,) if quick else (*DECODE_BATCHES, PREFILL_TOKENS)
    for r in LORA_RANKS[-1:] if quick else LORA_RANKS:  # quick: the widest rank tile
        adapters = (
            _t(flat, r, h, dtype=dtype),
            _t(flat, 2 * i, r, dtype=dtype),
            _t(flat, r, i, dtype=dtype),
            _t(flat, h, r, dtype=dtype),
        )
        for t in tokens:
            x, ids, w = _t(t, h, dtype=dtype), _t(t, top, dtype=torch.int64), _t(t, top)
            lora = ExpertLoraRows(*adapters, _t(t, dtype=torch.int64), r, LORA_SLOTS)
            yield Launch(
                f"r={r} T={t}",
                lambda x=x, ids=ids, w=w, lora=lora: k.fused_moe_lora_triton(
                    x, gate_up, down, ids, w, "silu", lora
                ),
            )


# NOTE: the sweep's kernel list; each family yields nothing for a rank without its layer.
FAMILIES: dict[str, Callable[[RankShape, torch.dtype, bool], Iterator[Launch]]] = {
    "short_conv": short_conv,
    "cca_conv": cca_conv,
    "attention": attention,
    "fused_moe": fused_moe,
    "lora": lora,
    "expert_lora": expert_lora,
}
