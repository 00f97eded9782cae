"""A server's process tree, read from /proc: our `serve run` (every Ray process it started is
its descendant) or llama-server. Resident memory and CPU time, process by process."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from deployments.serve.serve_run import serve_run

ROOT = Path(__file__).resolve().parents[1]
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def processes() -> dict[int, tuple[int, list[str]]]:
    """Every process now: pid -> (parent pid, command line)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except (OSError, ValueError, IndexError):
                continue
            out[int(d.name)] = (ppid, cmd)
    return out


def tree(pid: int) -> dict[int, str]:
    """`pid` and all its descendants: pid -> a short name (the command line's start)."""
    procs, members = processes(), {pid}
    grew = True
    while grew:
        more = {p for p, (ppid, _) in procs.items() if ppid in members} - members
        members |= more
        grew = bool(more)
    return {p: " ".join(procs[p][1])[:90] for p in members if p in procs}


def _kb_field(path: str, key: str) -> int:
    """Bytes of the `key:` line (in kB) of a /proc file; 0 once the process is gone."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_of(pid: int) -> int:
    return _kb_field(f"/proc/{pid}/status", "VmRSS:")


def pss_of(pid: int) -> int:
    """Proportional set size: resident bytes with each shared page split among the processes
    that map it (Ray's forked workers share much of their interpreter and libraries), so a
    tree's sum is the memory it holds, counted once."""
    return _kb_field(f"/proc/{pid}/smaps_rollup", "Pss:")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds `pid` has used (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def tree_memory(pid: int, show_mb: float = 50.0) -> tuple[int, int]:
    """(summed RSS, summed PSS) of the tree; prints each process of `show_mb` MB RSS or more."""
    sizes = sorted(((rss_of(p), pss_of(p), name) for p, name in tree(pid).items()), reverse=True)
    for rss, pss, name in sizes:
        if rss >= show_mb * 1e6:
            print(f"#   {rss / 1e6:6.0f} MB RSS {pss / 1e6:6.0f} MB PSS  {name}", flush=True)
    return sum(r for r, _, _ in sizes), sum(p for _, p, _ in sizes)


def cpu_snapshot(pid: int) -> dict[int, tuple[str, float]]:
    return {p: (name, cpu_s(p)) for p, name in tree(pid).items()}


def cpu_used(before: dict[int, tuple[str, float]], pid: int) -> list[tuple[float, str]]:
    """CPU seconds each process of the tree used since `before`, largest first."""
    now = cpu_snapshot(pid)
    used = [(s - before.get(p, (name, 0.0))[1], name) for p, (name, s) in now.items()]
    return sorted(used, reverse=True)


@contextmanager
def ours(
    model_args: dict[str, object], timeout_s: float, env: dict[str, str] | None = None
) -> Iterator[tuple[str, int]]:
    """`serve run deployments/lfm2.yaml` with `model_args` set in its args (nothing else, and
    no environment of ours unless `env`, a diagnosis run's); yields (URL, the serve run pid)."""
    config = yaml.safe_load((ROOT / "deployments" / "lfm2.yaml").read_text())
    config["applications"][0]["args"].update(model_args)
    with serve_run(config, timeout_s, env) as (url, log):
        cfg = str(log.parent / "serve.yaml")  # NOTE: serve_run's layout: the config by the log
        yield url, next(p for p, (_, cmd) in processes().items() if cfg in cmd)


def with_visible_tokens(model_dir: Path) -> Path:
    """A sibling of `model_dir` whose `<|reserved_N|>` tokens are plain text, `[rN]`.

    Our random checkpoints fill their vocab with reserved special tokens, and a random model's
    greedy picks are nearly all of them: both servers then stream events with empty text (they
    skip special tokens; llama.cpp's converter also makes every `<|...|>` token a control
    token), and a client that counts text sees no tokens. Renamed and not special, each decodes
    to its name on both servers, so every generated token is one visible piece. Token ids and
    weights are unchanged (the weights are symlinked)."""
    out = model_dir.with_name(model_dir.name + "-text")
    out.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "tokenizer.json" and not (out / f.name).exists() and f.suffix != ".gguf":
            (out / f.name).symlink_to(f.resolve())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    for added in tok.get("added_tokens", []):
        if added["content"].startswith("<|reserved_"):
            added["content"] = "[r" + added["content"][len("<|reserved_") : -2] + "]"
            added["special"] = False
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out
