"""bench/kernels.py's attention and MoE sections on CPU, with stand-in kernels (the Triton ones
live on other branches): the oracles agree with independent vectorised implementations, a wrong
kernel is caught, and byte counts follow the shapes."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import kernel_cases as kc  # noqa: E402
import kernels  # noqa: E402


def sdpa_paged(q, k_cache, v_cache, block_tables, seq_lens, scale, page_size, *, out=None):  # noqa: ANN001, ANN201
    """Independent of the oracle: pad every row's pages to one length and mask with SDPA."""
    b, hq, d = q.shape
    hk = k_cache.shape[1]
    rows = block_tables.long()[:, :, None] * page_size + torch.arange(page_size)
    rows = rows.flatten(1)  # [B, P*page]
    k = k_cache[rows].transpose(1, 2).float()  # [B, Hk, L, d]
    v = v_cache[rows].transpose(1, 2).float()
    mask = torch.arange(rows.shape[1])[None, :] < seq_lens[:, None]
    res = F.scaled_dot_product_attention(
        q.float()[:, :, None],
        k.repeat_interleave(hq // hk, 1),
        v.repeat_interleave(hq // hk, 1),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )[:, :, 0]
    out = torch.empty_like(q) if out is None else out
    return out.copy_(res)


def dense_moe(x, gate_up, down, ids, weights, activation, *, out=None, scale=1.0):  # noqa: ANN001, ANN201
    e = gate_up.shape[0]
    dense = torch.zeros(x.shape[0], e + 1).scatter_add_(1, ids.long(), weights.float())[:, :e]
    gu = torch.einsum("eih,th->tei", gate_up.float(), x.float())
    inter = down.shape[-1]
    act = F.silu(gu[..., :inter]) * gu[..., inter:]
    y = torch.einsum("ehi,tei->teh", down.float(), act)
    res = scale * (dense[..., None] * y).sum(1)
    out = torch.empty_like(x) if out is None else out
    return out.copy_(res)


def _install(monkeypatch: pytest.MonkeyPatch, scale: float = 1.0) -> None:
    attn = types.ModuleType("shortconv.kernels.attention_triton")
    attn.paged_attention_decode_triton = lambda *a, **k: sdpa_paged(
        *a[:5], a[5] * scale, *a[6:], **k
    )  # scale != 1: a wrong softmax scale
    moe = types.ModuleType("shortconv.kernels.moe_triton")
    moe.fused_moe_triton = lambda *a, **k: dense_moe(*a, **k, scale=scale)
    monkeypatch.setitem(sys.modules, attn.__name__, attn)
    monkeypatch.setitem(sys.modules, moe.__name__, moe)


def _cfg() -> argparse.Namespace:
    cfg = argparse.Namespace(device="cpu", dtype=torch.float32, bench=lambda fn: (fn(), 1e-3)[1])
    cfg.attn, cfg.moe = kc.shapes(quick=True)
    cfg.check_attn, cfg.check_moe = kc.check_shapes(quick=True)
    return cfg


def test_sections_agree_with_independent_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch)
    rows, status = kernels.run_sections(_cfg(), ["attention", "moe"])
    assert status == {"attention": "ok", "moe": "ok"}
    assert [r[0] for r in rows] == ["attention_triton", "moe_triton"]


def test_a_wrong_kernel_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, scale=1.1)
    _, status = kernels.run_sections(_cfg(), ["attention", "moe"])
    assert status == {"attention": "error", "moe": "error"}


def test_byte_counts() -> None:
    s = kc.AttnShape(4, 2, 8, 3, 20)
    (q, k, _, bt, sl, _, _), nbytes = kc.attention_case(s, "cpu", torch.bfloat16)
    kv = 2 * 3 * 20 * 2 * 8 * 2
    assert nbytes == kv + 2 * q.numel() * 2 + bt.numel() * 4 + 3 * 4
    m = kc.MoeShape(8, 16, 4, 1, 1, skip=False)
    (x, gu, dn), routes, mbytes = kc.moe_case(m, "cpu", torch.bfloat16, sets=2)
    one_expert = (gu[0].numel() + dn[0].numel()) * 2
    assert mbytes == one_expert + 2 * x.numel() * 2 + 12  # one token, one expert, no skip
