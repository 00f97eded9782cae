"""Kernel bandwidth (short conv, paged attention decode, fused MoE) against the device's copy.

    PYTHONPATH=. python bench/kernels.py           # GPU: compiled Triton kernels
    PYTHONPATH=. python bench/kernels.py --warmup  # GPU: compile every benchmarked shape, no timing
    PYTHONPATH=. python bench/kernels.py --quick   # CPU: tiny sizes under TRITON_INTERPRET=1
    PYTHONPATH=. python bench/kernels.py --dry-run # import what the GPU run imports, then exit

All are memory-bound at these sizes (a few FLOPs per byte), so the figure of merit is achieved
bandwidth = bytes that must move / time, divided by the bandwidth of a plain device-to-device
copy measured here (read + write of one large buffer). Times are triton.testing.do_bench
medians on GPU. On CPU the interpreter is orders of magnitude slower than any real kernel: the
quick run proves the harness works, its ratios mean nothing. Attention and MoE are checked
against plain fp32 oracles (bench/kernel_cases.py) at a small case before they are timed; a
section whose kernel module is missing or fails is reported as such and the others still run.
Target: attention decode at the largest batch x context >= 0.70 of copy bandwidth.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_cases as kc  # noqa: E402

from shortconv.kernels.conv1d_ref import (  # noqa: E402
    causal_conv1d_fn_ref,
    causal_conv1d_update_ref,
)

# NOTE: everything the GPU run imports beyond the top of this file; --dry-run imports exactly
# these.
GPU_IMPORTS = (
    "triton",
    "triton.testing",
    "shortconv.kernels.conv1d_triton",
    "shortconv.kernels.attention_triton",
    "shortconv.kernels.moe_triton",
)
ATTN_TARGET = 0.70
# The GPU run's short-conv sizes: decode (batch, dim) and prefill (seqs, seqlen, dim).
GPU_UPDATES = [(128, 2048), (1024, 2048), (4096, 2048 + 16), (8192, 4096)]
GPU_FNS = [(8, 129, 2048 + 16), (64, 1024, 2048), (32, 2048, 4096)]
Row = tuple[str, str, float, float]  # kernel, shape, bytes/s, seconds


def _bench(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median seconds per call."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _bench(lambda: dst.copy_(src), device, reps)


def update_case(batch: int, dim: int, width: int, dtype: torch.dtype, device: str):
    """Decode update over `batch` rows with scattered slots: (args, bytes moved)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    slots = batch + 1
    x = torch.randn(batch, dim, generator=g).to(device, dtype)
    state = torch.randn(slots, dim, width - 1, generator=g).to(device, dtype)
    w = torch.randn(dim, width, generator=g).to(device, dtype)
    idx = (torch.randperm(batch, generator=g) + 1).to(device)
    return (x, state, w, None, idx), update_bytes(batch, dim, width, x.element_size())


def update_bytes(batch: int, dim: int, width: int, esz: int) -> int:
    """x read, out written, each row's state read and written, weights read once."""
    return esz * (2 * batch * dim + 2 * batch * dim * (width - 1) + dim * width)


def fn_bytes(seqs: int, seqlen: int, dim: int, width: int, esz: int) -> int:
    """x read, out written, each sequence's state read and written, weights read once."""
    return esz * (2 * seqs * seqlen * dim + 2 * seqs * dim * (width - 1) + dim * width)


def fn_case(seqs: int, seqlen: int, dim: int, width: int, dtype: torch.dtype, device: str):
    """Varlen prefill over seqs x seqlen tokens (token-major x, as ShortConv passes it)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    total = seqs * seqlen
    x = torch.randn(total, dim, generator=g).to(device, dtype).t()  # [dim, T] view
    state = torch.randn(seqs + 1, dim, width - 1, generator=g).to(device, dtype)
    w = torch.randn(dim, width, generator=g).to(device, dtype)
    qsl = (torch.arange(seqs + 1) * seqlen).to(device, torch.int32)
    idx = (torch.arange(seqs) + 1).to(device)
    init = torch.ones(seqs, dtype=torch.bool, device=device)
    nbytes = fn_bytes(seqs, seqlen, dim, width, x.element_size())
    return (x, w, None, state, qsl, idx, init), nbytes


def dry_run() -> None:
    for mod in GPU_IMPORTS:
        importlib.import_module(mod)
    print(f"DRYRUN kernels ok: imported {list(GPU_IMPORTS)}")


def conv_rows(cfg: argparse.Namespace) -> Iterator[Row]:
    from shortconv.kernels.conv1d_triton import (
        causal_conv1d_fn_triton,
        causal_conv1d_update_triton,
    )

    for batch, dim in cfg.updates:
        a, nbytes = update_case(batch, dim, 3, cfg.dtype, cfg.device)
        for name, fn in (
            ("update_triton", causal_conv1d_update_triton),
            ("update_ref", causal_conv1d_update_ref),
        ):
            t = cfg.bench(lambda fn=fn, a=a: fn(*a))
            yield name, f"B={batch} dim={dim}", nbytes / t, t
    for seqs, seqlen, dim in cfg.fns:
        a, nbytes = fn_case(seqs, seqlen, dim, 3, cfg.dtype, cfg.device)
        for name, fn in (("fn_triton", causal_conv1d_fn_triton), ("fn_ref", causal_conv1d_fn_ref)):
            t = cfg.bench(lambda fn=fn, a=a: fn(*a))
            yield name, f"seqs={seqs} len={seqlen} dim={dim}", nbytes / t, t


def attention_rows(cfg: argparse.Namespace) -> Iterator[Row]:
    from shortconv.kernels.attention_triton import paged_attention_decode_triton as attn

    args, _ = kc.attention_case(cfg.check_attn, cfg.device, cfg.dtype, seed=1, ragged=True)
    out = torch.full(args[0].shape, float("nan"), dtype=cfg.dtype, device=cfg.device)
    attn(*args, out=out)
    err = kc.rel_err(out, kc.attention_oracle(*args))
    print(f"CHECK attention {cfg.check_attn.label} rel_err={err:.2e}", flush=True)
    if not err < 2e-2:
        raise AssertionError(f"attention kernel differs from the fp32 oracle: {err:.2e}")
    for s in cfg.attn:
        args, nbytes = kc.attention_case(s, cfg.device, cfg.dtype)
        out = torch.empty_like(args[0])
        t = cfg.bench(lambda args=args, out=out: attn(*args, out=out))
        yield "attention_triton", s.label, nbytes / t, t
        del args, out


def moe_rows(cfg: argparse.Namespace) -> Iterator[Row]:
    from shortconv.kernels.moe_triton import fused_moe_triton as moe

    (x, gu, dn), routes, _ = kc.moe_case(cfg.check_moe, cfg.device, cfg.dtype, sets=1, seed=1)
    ids, w = routes[0]
    out = torch.full(x.shape, float("nan"), dtype=cfg.dtype, device=cfg.device)
    moe(x, gu, dn, ids, w, "silu", out=out)
    err = kc.rel_err(out, kc.moe_oracle(x, gu, dn, ids, w))
    print(f"CHECK moe {cfg.check_moe.label} rel_err={err:.2e}", flush=True)
    if not err < 2e-2:
        raise AssertionError(f"fused MoE kernel differs from the fp32 oracle: {err:.2e}")
    for s in cfg.moe:
        (x, gu, dn), routes, nbytes = kc.moe_case(s, cfg.device, cfg.dtype)
        out, nxt = torch.empty_like(x), itertools.cycle(routes).__next__
        t = cfg.bench(
            lambda x=x, gu=gu, dn=dn, out=out, nxt=nxt: moe(x, gu, dn, *nxt(), "silu", out=out)
        )
        yield "moe_triton", s.label + (" +skip" if s.skip else ""), nbytes / t, t


SECTIONS: dict[str, Callable[[argparse.Namespace], Iterator[Row]]] = {
    "conv": conv_rows,
    "attention": attention_rows,
    "moe": moe_rows,
}


def configure(args: argparse.Namespace) -> argparse.Namespace:
    """Device, dtype, sizes and the timing function for this run."""
    cfg = argparse.Namespace()
    if args.quick:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first jitted
        torch.set_num_threads(1)
        cfg.device, cfg.dtype, reps, cfg.copy_bytes = "cpu", torch.float32, 3, 1 << 22
        cfg.updates, cfg.fns = [(8, 64)], [(2, 17, 64)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("kernels.py needs CUDA; use --quick for the CPU smoke run")
        cfg.device, cfg.dtype, reps, cfg.copy_bytes = "cuda", torch.bfloat16, 0, 1 << 30
        cfg.updates, cfg.fns = GPU_UPDATES, GPU_FNS
    cfg.attn, cfg.moe = kc.shapes(args.quick)
    cfg.check_attn, cfg.check_moe = kc.check_shapes(args.quick)
    if args.warmup:  # one call compiles the kernel for the shape; nothing is timed
        cfg.bench = lambda fn: (fn(), _sync(cfg.device), 1.0)[-1]
    else:
        cfg.bench = lambda fn: _bench(fn, cfg.device, reps)
    return cfg


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_sections(cfg: argparse.Namespace, names: list[str]) -> tuple[list[Row], dict[str, str]]:
    """Rows of every section that ran, and each section's status (ok / missing / error)."""
    rows, status = [], {}
    for name in names:
        try:
            for row in SECTIONS[name](cfg):
                rows.append(row)
                print(f"  {row[0]:16s} {row[1]:36s} {row[3] * 1e6:10.1f} us", flush=True)
            status[name] = "ok"
        except ImportError as exc:
            status[name] = "missing"
            print(f"# {name}: kernel module missing ({exc})", flush=True)
        except Exception:  # noqa: BLE001 - report the section, keep the others
            status[name] = "error"
            print(f"# {name}: FAILED\n{traceback.format_exc()}", flush=True)
        if cfg.device == "cuda":
            torch.cuda.empty_cache()
    return rows, status


def report(rows: list[Row], status: dict[str, str], copy_bw: float) -> None:
    for name, shape, bw, t in rows:
        print(
            f"{name:16s} {shape:36s} {t * 1e6:10.1f} us  {bw / 1e9:8.1f} GB/s  "
            f"{bw / copy_bw:6.3f} of copy"
        )
    for name, shape, bw, _ in rows:
        if name.endswith("triton"):
            print(
                f"SUMMARY kernels {name} {shape.replace(' ', ',')} "
                f"GBps={bw / 1e9:.1f} ratio_vs_copy={bw / copy_bw:.3f}"
            )
    attn = [r for r in rows if r[0] == "attention_triton"]
    if attn:  # the target is read at the largest batch x context (the last attention case)
        ratio = attn[-1][2] / copy_bw
        verdict = "pass" if ratio >= ATTN_TARGET else "FAIL"
        print(
            f"SUMMARY target attention_decode_vs_copy value={ratio:.3f} "
            f"target>={ATTN_TARGET} {verdict} ({attn[-1][1]})"
        )
    for name, st in status.items():
        print(f"SUMMARY kernels section={name} status={st}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU interpreter smoke run")
    p.add_argument("--warmup", action="store_true", help="compile every shape once, no timing")
    p.add_argument("--dry-run", action="store_true", help="import everything, parse, exit")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma list of " + "/".join(SECTIONS)
    )
    args = p.parse_args(argv)
    names = [n for n in args.sections.split(",") if n]
    if unknown := set(names) - set(SECTIONS):
        p.error(f"unknown sections {sorted(unknown)}")
    if args.dry_run:
        dry_run()
        return 0
    cfg = configure(args)
    t0 = time.perf_counter()
    copy_bw = 1.0 if args.warmup else copy_bandwidth(cfg.device, cfg.copy_bytes, 3)
    print(f"# {cfg.device} {cfg.dtype}: device-to-device copy {copy_bw / 1e9:.1f} GB/s", flush=True)
    rows, status = run_sections(cfg, names)
    if args.warmup:
        print(
            f"# warmup: {len(rows)} kernel shapes compiled in {time.perf_counter() - t0:.1f}s, "
            f"sections {status}"
        )
    else:
        report(rows, status, copy_bw)
    if args.warmup:
        return 0  # compiling is best effort; the timed run reports missing or failing sections
    missing_ok = args.quick  # on CPU a kernel module not merged yet is not a failure
    bad = [n for n, st in status.items() if st == "error" or (st == "missing" and not missing_ok)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
