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

from deployments.serve_run import (
    RAY_START_TIMED_OUT,
    free_port,  # noqa: F401  (re-exported for the tests)
)


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
    prefix: str, env_vars: dict[str, str] | None = None, num_cpus: float = 4, **init: Any
) -> Iterator[None]:
    """`ray.init(address="local")` on a shared machine: never joins or stops anyone else's Ray.

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
        runtime_env={"env_vars": env_vars or {}},
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
