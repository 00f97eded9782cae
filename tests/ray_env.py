"""A private Ray runtime per test module: own temp dir, no dashboard, loopback ports, torn down."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from deployments.serve.serve_run import (
    RAY_START_TIMED_OUT,
    free_port,  # noqa: F401  (re-exported for the tests)
)


def descendant_pids(marker: str) -> list[int]:
    """Processes below this test process (our Ray runtime's, Linux) whose command line holds
    `marker` (a Ray actor's title such as "ray::TPWorker", or a module run with -m)."""
    parent, title = {}, {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit():
                stat = (d / "stat").read_text()
                parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
                title[int(d.name)] = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            pass  # the process went away while we looked
    mine, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - mine
        mine |= frontier
    return sorted(pid for pid in mine if marker in title.get(pid, ""))


def model_cache(base: Path) -> Path:
    """The XDG cache of one test worker (`base`: its pytest base temp): `model: null` builds the
    tiny checkpoints into it once per worker instead of once per module (each is built in a temp
    dir and renamed into place, so replicas and modules sharing it never see half a checkpoint).
    """
    path = base / "xdg-cache"
    path.mkdir(exist_ok=True)
    return path


@contextmanager
def private_ray(
    prefix: str,
    env_vars: dict[str, str] | None = None,
    num_cpus: float = 4,
    runtime_env: dict[str, Any] | None = None,
    **init: Any,
) -> Iterator[None]:
    """`ray.init(address="local")` on a shared machine: never joins or stops anyone else's Ray.
    `runtime_env`: the job's, besides `env_vars` (a local `working_dir` is uploaded as a
    `gcs://` package, as `serve run` does).

    NOTE: the temp dir is short on purpose: Ray's socket paths live under it.
    """
    import ray

    tmp = tempfile.mkdtemp(prefix=prefix)
    kwargs = dict(
        address="local",
        include_dashboard=False,
        _temp_dir=tmp,
        num_cpus=num_cpus,
        object_store_memory=128 * 1024 * 1024,
        runtime_env={**(runtime_env or {}), "env_vars": env_vars or {}},
        **init,
    )
    try:
        _init_once_more_if_late(tmp, kwargs)
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _init_once_more_if_late(tmp: str, kwargs: dict[str, Any]) -> None:
    """Ray gives a starting node a fixed 30 s to register; two test workers starting Ray on a
    loaded 2-core machine can miss it. Then the late start's processes are killed and Ray is
    started once more."""
    import ray

    try:
        ray.init(**kwargs)
    except Exception as exc:
        if RAY_START_TIMED_OUT not in str(exc):
            raise
        ray.shutdown()
        _kill_processes_naming(tmp)
        ray.init(**kwargs)


def _kill_processes_naming(tmp: str) -> None:
    """SIGKILL every process whose command line names `tmp` (the failed start's GCS, raylet and
    agents all take paths under it)."""
    needle = tmp.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours
            continue
