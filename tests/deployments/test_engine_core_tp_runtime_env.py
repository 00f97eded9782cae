"""tp_size=2 under a real `serve.run` whose application has a runtime env (a local
`working_dir` and `py_modules`, which Ray uploads as `gcs://_ray_pkg_*.zip` packages, and
`env_vars`), as a KubeRay RayService's serveConfig carries one: the engine core process rejoins
the cluster with the replica's runtime env, so its TP workers import the same packages and see
the same env vars as the replica, and the tokens over HTTP are transformers' greedy tokens.

The probe: the working dir holds a `sitecustomize.py`, which Python imports at the start of
every process that has the working dir on its PYTHONPATH (Ray puts it there for each worker
started in that runtime env). It records, per PID, what that process sees (the env var, the
marker module, its cwd); the test matches the PIDs to the replica, the core and the TP workers.
Nothing of it ships: it exists only in the test's temp working dir.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from oracle import assert_matches_oracle, oracle_greedy
from ray_env import descendant_pids
from reliability_helpers import CORE, serve_app

from shortconv.tiny.checkpoint import build_hf_model, make_tiny_checkpoint

ARCH, SEED = "lfm2", 5
PROMPTS = [[5, 6, 7, 8, 9], [11, 40, 2, 77, 250, 19, 3]]
MAX_NEW = 8
MARKER = "workdir-marker-7f3a"  # the env var's value and the marker module's constant
TP_WORKER, REPLICA = "ray::TPWorker", "LLMServer"

# NOTE: the records' dir is written into the probe, not passed as an env var, so a process
# that lacks the runtime env's env vars still reports.
PROBE = """
import json, os
_rec = {"cwd": os.getcwd(), "env": os.environ.get("SCPROBE_MARKER")}
try:
    import scprobe_marker
    _rec.update(module=scprobe_marker.__file__, marker=scprobe_marker.MARKER)
except ImportError as exc:
    _rec.update(module=None, marker=repr(exc))
try:
    import scprobe_pkg
    _rec.update(pkg=scprobe_pkg.__file__, pkg_marker=scprobe_pkg.MARKER)
except ImportError as exc:
    _rec.update(pkg=None, pkg_marker=repr(exc))
with open(os.path.join(%r, "%%d.json" %% os.getpid()), "w") as _f:
    json.dump(_rec, _f)
"""


def working_dir(root: Path, probes: Path) -> Path:
    """The application's working dir: the probe (writing to `probes`), a marker module and
    file, and a big folder the runtime env excludes (never uploaded)."""
    wd = root / "app"
    (wd / "big").mkdir(parents=True)
    (wd / "sitecustomize.py").write_text(PROBE % str(probes))
    (wd / "scprobe_marker.py").write_text(f"MARKER = {MARKER!r}\n")
    (wd / "marker.txt").write_text(MARKER)
    (wd / "big" / "blob.bin").write_bytes(b"\0" * (1 << 20))
    return wd


def py_module(root: Path) -> Path:
    """A package for `py_modules` (uploaded as a `gcs://` package of its own)."""
    pkg = root / "mods" / "scprobe_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"MARKER = {MARKER!r}\n")
    return pkg


ARGS = {"dtype": "float32", "tp_size": 2, "engine_process": True, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(base URL, the probe records' dir). The job's runtime env, which
    `serve.run` gives the app's replicas: the working dir (uploaded as a `gcs://` package)
    and the marker env var."""
    root = tmp_path_factory.mktemp("workdir")
    ckpt = make_tiny_checkpoint(ARCH, root / "ckpt", seed=SEED, with_tokenizer=False)
    probes = root / "probes"
    probes.mkdir()
    env = {"SCPROBE_MARKER": MARKER}
    runtime_env = {
        "working_dir": str(working_dir(root, probes)),
        "excludes": ["big/"],
        "py_modules": [str(py_module(root))],
    }
    args = {**ARGS, "model": str(ckpt)}
    with serve_app(root, args, env, runtime_env=runtime_env, num_replicas=1) as url:
        yield url, probes


def seen_by(probes: Path, marker: str) -> list[dict[str, Any]]:
    """The probe records of our processes whose command line holds `marker`."""
    pids = descendant_pids(marker)
    assert pids, f"no process {marker!r}"
    missing = [p for p in pids if not (probes / f"{p}.json").is_file()]
    assert not missing, f"{marker} PIDs {missing} never imported the working dir's code"
    return [json.loads((probes / f"{p}.json").read_text()) for p in pids]


def test_tp_workers_get_the_replicas_working_dir_py_modules_and_env_vars(
    served: tuple[str, Path],
) -> None:
    _, probes = served
    (replica,) = seen_by(probes, REPLICA)
    (core,) = seen_by(probes, CORE)
    ranks = seen_by(probes, TP_WORKER)
    assert len(ranks) == 2
    want = {"env": MARKER, "marker": MARKER, "pkg_marker": MARKER}
    pkg = Path(replica["cwd"])
    # Serve uploaded the local dir as a gcs:// package, unpacked on this node.
    assert pkg.name.startswith("_ray_pkg_") and (pkg / "marker.txt").read_text() == MARKER
    assert not (pkg / "big").exists()  # excluded from the upload
    assert replica["module"] == str(pkg / "scprobe_marker.py")
    assert "/_ray_pkg_" in replica["pkg"]  # py_modules: a gcs:// package of its own
    for who, rec in [("core", core), ("rank 0", ranks[0]), ("rank 1", ranks[1])]:
        assert {k: rec[k] for k in want} == want, (who, rec)
        assert (rec["module"], rec["pkg"]) == (replica["module"], replica["pkg"]), (who, rec)
    for rank in ranks:  # the workers run in the package, as the replica does
        assert rank["cwd"] == replica["cwd"]


def test_tokens_over_http_equal_transformers(served: tuple[str, Path]) -> None:
    base, _ = served
    hf = build_hf_model(ARCH, seed=SEED).eval()
    body = {"prompt": PROMPTS, "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 1}, timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        # NOTE: no tokenizer in the checkpoint: the server names each token by its id
        names = choice["logprobs"]["tokens"]
        assert all(n.startswith("token_id:") for n in names), names
        prompt = PROMPTS[choice["index"]]
        ours = [int(n.removeprefix("token_id:")) for n in names]
        assert_matches_oracle(ours, oracle_greedy(hf, prompt, MAX_NEW), f"HTTP {prompt}")
