"""Where `serve run deployments/lfm2.yaml`'s memory goes: every process's PSS, and for the
engine core and the LLM replica their mappings by kind (weights file, shared libraries,
anonymous heap, the largest anonymous mappings), at ready and after a few requests.

    .venv/bin/python bench/serve_mappings.py --model DIR [--requests 4] [--env K=V ...]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_procs import ours, pss_of, tree  # noqa: E402

_ROLES = {"engine_core": "core", "LLMServer": "replica"}


def mappings(pid: int) -> list[tuple[str, int, int]]:
    """(name, size bytes, Pss bytes) of every mapping of `pid` (name "" = anonymous)."""
    out: list[tuple[str, int, int]] = []
    name, size = "", 0
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            name, size = (head[5] if len(head) > 5 else ""), hi - lo
        elif head[0] == "Pss:":
            out.append((name, size, int(head[1]) * 1024))
    return out


def kind(name: str) -> str:
    """A mapping's group: the weights file, one shared library, heap, anonymous, other file."""
    if name.endswith(".safetensors"):
        return "weights (safetensors mmap)"
    if ".so" in name:
        return "lib " + Path(name).name.split(".so")[0]
    if name in ("", "[heap]"):
        return "anonymous" if name == "" else "[heap]"
    return "file/other " + (name if name.startswith("[") else Path(name).suffix or name[-30:])


def breakdown(pid: int, top: int = 12) -> None:
    maps = mappings(pid)
    groups: dict[str, int] = defaultdict(int)
    for name, _size, pss in maps:
        groups[kind(name)] += pss
    libs = sum(v for k, v in groups.items() if k.startswith("lib "))
    print(f"#     shared libraries together: {libs / 1e6:7.1f} MB")
    for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:top]:
        print(f"#     {v / 1e6:7.1f} MB  {k}")
    anon = sorted((m for m in maps if m[0] == ""), key=lambda m: -m[2])[:top]
    print("#     largest anonymous mappings (Pss / size):")
    for _name, size, pss in anon:
        print(f"#       {pss / 1e6:7.1f} / {size / 1e6:7.1f} MB")


def report(serve_pid: int, when: str) -> None:
    procs = tree(serve_pid)
    rows = sorted(((pss_of(p), p, name) for p, name in procs.items()), reverse=True)
    print(f"# --- {when}: tree PSS {sum(r[0] for r in rows) / 1e9:.2f} GB", flush=True)
    for pss, pid, name in rows:
        if pss >= 20e6:
            print(f"#   {pss / 1e6:7.0f} MB PSS  {pid:7d} {name[:80]}")
    for pss, pid, name in rows:
        role = next((r for key, r in _ROLES.items() if key in name), None)
        if role:
            print(f"#   {role} ({pid}), {pss / 1e6:.0f} MB PSS:")
            breakdown(pid)


def chat(url: str, n: int) -> None:
    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    for i in range(n):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Tell me a story number {i}."}],
            "max_tokens": 32,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--env", nargs="*", default=[], help="K=V for `serve run`'s environment")
    args = p.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in args.env) or None
    with ours({"model": args.model}, args.timeout, env) as (url, pid):
        report(pid, "ready")
        chat(url, args.requests)
        report(pid, f"after {args.requests} requests")


if __name__ == "__main__":
    main()
