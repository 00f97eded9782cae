"""Join the caller's Ray runtime, or start a private local one when there is none.

`LLM(model, tp_size=2)` from a plain Python process has no Ray yet. We then start a runtime of
our own (never joining a cluster found through RAY_ADDRESS by accident: address="local"), in our
own temp dir, without the dashboard, and shut it down when the last executor using it leaves —
but never a runtime the caller started.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading

import ray

log = logging.getLogger(__name__)

# Object store of a runtime we start: step plans and results are small and weights are read
# from disk by each worker, so Ray's default (30% of RAM) would only reserve shared memory.
_OBJECT_STORE_BYTES = 256 * 1024 * 1024

_lock = threading.Lock()
_owned_temp_dir: str | None = None
_num_users = 0


def acquire_runtime(num_cpus: float | None = None) -> bool:
    """Make sure Ray is initialised; returns True when this call's runtime is ours to release."""
    global _owned_temp_dir, _num_users
    with _lock:
        if ray.is_initialized():
            if _owned_temp_dir is None:
                return False  # the caller's runtime: never ours to shut down
            _num_users += 1
            return True
        # NOTE: a short root, since Ray's unix socket paths under it must stay under 108 bytes.
        temp_dir = tempfile.mkdtemp(prefix="scray-")
        cpus = max(int(num_cpus or 0), os.cpu_count() or 1)
        ray.init(
            address="local",
            include_dashboard=False,
            _temp_dir=temp_dir,
            num_cpus=cpus,
            object_store_memory=_OBJECT_STORE_BYTES,
            log_to_driver=True,
        )
        log.info("started a local Ray runtime (%d CPUs) in %s", cpus, temp_dir)
        _owned_temp_dir, _num_users = temp_dir, 1
        atexit.register(_at_exit, temp_dir)
        return True


def _at_exit(temp_dir: str) -> None:
    """An LLM never shut down still leaves no runtime or temp dir behind at interpreter exit."""
    if _owned_temp_dir == temp_dir:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def release_runtime() -> None:
    """Drop one user of the runtime we started; the last one out shuts it down."""
    global _owned_temp_dir, _num_users
    with _lock:
        if _owned_temp_dir is None or _num_users == 0:
            return
        _num_users -= 1
        if _num_users:
            return
        temp_dir, _owned_temp_dir = _owned_temp_dir, None
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        log.info("shut down the local Ray runtime")
