"""Short-conv kernel bandwidth against the device's own copy bandwidth (the roofline).

    PYTHONPATH=. python bench/kernels.py           # GPU: compiled Triton kernels
    PYTHONPATH=. python bench/kernels.py --quick   # CPU: tiny sizes under TRITON_INTERPRET=1

Both kernels are memory-bound (a few FLOPs per byte), so the figure of merit is achieved
bandwidth = bytes that must move / time, divided by the bandwidth of a plain device-to-device
copy measured here (read + write of one large buffer). Times are triton.testing.do_bench
medians on GPU. On CPU the interpreter is orders of magnitude slower than any real kernel: the
quick run proves the harness works, its ratios mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shortconv.kernels.conv1d_ref import (  # noqa: E402
    causal_conv1d_fn_ref,
    causal_conv1d_update_ref,
)


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
    esz = x.element_size()
    # x read, out written, each row's state read and written, weights read once.
    nbytes = esz * (2 * batch * dim + 2 * batch * dim * (width - 1) + dim * width)
    return (x, state, w, None, idx), nbytes


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
    esz = x.element_size()
    nbytes = esz * (2 * total * dim + 2 * seqs * dim * (width - 1) + dim * width)
    return (x, w, None, state, qsl, idx, init), nbytes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU interpreter smoke run")
    args = p.parse_args(argv)
    if args.quick:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first jitted
        torch.set_num_threads(1)
        device, dtype, reps, copy_bytes = "cpu", torch.float32, 3, 1 << 22
        updates, fns = [(8, 64)], [(2, 17, 64)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("kernels.py needs CUDA; use --quick for the CPU smoke run")
        device, dtype, reps, copy_bytes = "cuda", torch.bfloat16, 0, 1 << 30
        updates = [(128, 2048), (1024, 2048), (4096, 2048 + 16), (8192, 4096)]
        fns = [(8, 129, 2048 + 16), (64, 1024, 2048), (32, 2048, 4096)]
    from shortconv.kernels.conv1d_triton import (
        causal_conv1d_fn_triton,
        causal_conv1d_update_triton,
    )

    copy_bw = copy_bandwidth(device, copy_bytes, reps)
    print(f"# {device} {dtype}: device-to-device copy {copy_bw / 1e9:.1f} GB/s")
    rows = []
    for batch, dim in updates:
        a, nbytes = update_case(batch, dim, 3, dtype, device)
        for name, fn in (("update_triton", causal_conv1d_update_triton),
                         ("update_ref", causal_conv1d_update_ref)):  # fmt: skip
            t = _bench(lambda fn=fn, a=a: fn(*a), device, reps)
            rows.append((name, f"B={batch} dim={dim}", nbytes / t, t))
    for seqs, seqlen, dim in fns:
        a, nbytes = fn_case(seqs, seqlen, dim, 3, dtype, device)
        for name, fn in (("fn_triton", causal_conv1d_fn_triton), ("fn_ref", causal_conv1d_fn_ref)):
            t = _bench(lambda fn=fn, a=a: fn(*a), device, reps)
            rows.append((name, f"seqs={seqs} len={seqlen} dim={dim}", nbytes / t, t))
    for name, shape, bw, t in rows:
        print(f"{name:14s} {shape:28s} {t * 1e6:10.1f} us  {bw / 1e9:8.1f} GB/s  "
              f"{bw / copy_bw:6.3f} of copy")  # fmt: skip
    for name, shape, bw, _ in rows:
        if name.endswith("triton"):
            print(f"SUMMARY kernels {name} {shape.replace(' ', ',')} "
                  f"GBps={bw / 1e9:.1f} ratio_vs_copy={bw / copy_bw:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
