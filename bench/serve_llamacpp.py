"""llama.cpp's side of bench/serve_vs_llamacpp.py: find or build `llama-server`, convert a
checkpoint to an f32 GGUF, start the server.

The build follows what a user choosing a server would do: the llama-cpp-python sdist
(`pip download --no-deps --no-binary :all: llama-cpp-python==VERSION`) vendors llama.cpp; only
the `llama-server` CMake target is built, in a cache directory reused by later runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist the numbers were measured with
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shortconv" / "llama.cpp"


def source_dir() -> Path:
    """The vendored llama.cpp tree of the unpacked sdist (may not exist yet)."""
    return CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def built_server() -> Path:
    return source_dir() / "build" / "bin" / "llama-server"


def find_server(explicit: str | None) -> tuple[Path | None, str]:
    """(path or None, where it comes from): --llama-server, $LLAMA_SERVER, PATH, the cache."""
    for path, origin in (
        (explicit, "--llama-server"),
        (os.environ.get("LLAMA_SERVER"), "$LLAMA_SERVER"),
        (shutil.which("llama-server"), "PATH"),
        (str(built_server()), "the build cache"),
    ):
        if path and Path(path).is_file() and os.access(path, os.X_OK):
            return Path(path), origin
    return None, f"would build {built_server()} from the llama-cpp-python {LLAMA_CPP_PYTHON} sdist"


def build_server(jobs: int) -> Path:
    """Download the sdist, unpack it, build the `llama-server` target only (Release, native)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    if not source_dir().is_dir():
        spec = f"llama-cpp-python=={LLAMA_CPP_PYTHON}"
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, spec, "-d", str(CACHE)], check=True)
        (sdist,) = CACHE.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    src, build = source_dir(), source_dir() / "build"
    configure = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"]
    subprocess.run([*configure, "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"], check=True)
    target = ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]
    subprocess.run(target, check=True)
    return built_server()


def convert_f32(model_dir: Path, out: Path) -> Path:
    """The checkpoint as an f32 GGUF, with llama.cpp's own convert_hf_to_gguf.py (cached)."""
    if out.is_file():
        return out
    src = source_dir()
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    script = src / "convert_hf_to_gguf.py"
    cmd = [sys.executable, str(script), str(model_dir), "--outtype", "f32", "--outfile", str(out)]
    subprocess.run(cmd, check=True, env=env)
    return out


def server_command(server: Path, gguf: Path, port: int, threads: int, slots: int) -> list[str]:
    """The issue's llama-server settings: all threads, a 16k context split over `slots`."""
    return [
        str(server),
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(threads), "-c", str(512 * slots), "-np", str(slots)),
    ]
