from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# NOTE: tests import helpers (oracle.py) from this folder and the packages from the repo root.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from xdist_units import make_scheduler, ray_first, yield_cpu_unless_ray  # noqa: E402

# Serve kills a proxy that is not ready within 5 s, and fails its health check after 10 s; with
# two Ray clusters starting beside the other tests' work on 2 cores, both are missed now and then.
# The test processes' Ray (started from here, or by `serve run` children) inherits these.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")

# Under pytest-xdist (`make test` runs workers) the cores are split between the workers, so
# they never oversubscribe them with torch threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _WORKERS > 1:
        yield_cpu_unless_ray(Path(item.fspath))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ray_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return make_scheduler(config, log)
