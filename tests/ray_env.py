"""A private Ray runtime per test module: own temp dir, no dashboard, loopback ports, torn down."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from deployments.serve_run import free_port  # noqa: F401  (re-exported for the tests)


@contextmanager
def private_ray(
    prefix: str, env_vars: dict[str, str] | None = None, num_cpus: float = 4, **init: Any
) -> Iterator[None]:
    """`ray.init(address="local")` on a shared machine: never joins or stops anyone else's Ray.

    NOTE: the temp dir is short on purpose: Ray's socket paths live under it.
    """
    import ray

    tmp = tempfile.mkdtemp(prefix=prefix)
    ray.init(
        address="local",
        include_dashboard=False,
        _temp_dir=tmp,
        num_cpus=num_cpus,
        object_store_memory=128 * 1024 * 1024,
        runtime_env={"env_vars": env_vars or {}},
        **init,
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
