"""llama.cpp's side of bench/serve_vs_llamacpp.py: find or build `llama-server`, convert a
checkpoint to an f32 GGUF, start the server.

The build follows what a user choosing a server would do: the llama-cpp-python sdist (fetched
from the package index, the file `pip download --no-deps --no-binary :all:` would get) vendors
llama.cpp; only the `llama-server` CMake target is built, in a cache directory reused by later
runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import httpx

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


def fetch_sdist() -> Path:
    """The sdist from the package index's JSON API (PEP 691). Not `pip download --no-binary
    :all:`: that prepares the sdist's metadata, and the flag makes pip build every build
    dependency (scikit-build-core, hatchling, setuptools, ...) from source first, recursively."""
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    CACHE.mkdir(parents=True, exist_ok=True)
    out = CACHE / name
    if out.is_file():
        return out
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    accept = {"Accept": "application/vnd.pypi.simple.v1+json"}
    files = httpx.get(f"{index}/llama-cpp-python/", headers=accept, timeout=60).json()["files"]
    (url,) = [f["url"] for f in files if f["filename"] == name]
    with httpx.stream("GET", url, timeout=300, follow_redirects=True) as r, out.open("wb") as f:
        r.raise_for_status()
        for block in r.iter_bytes():
            f.write(block)
    return out


# cpuinfo flag -> ggml's CMake option. The build is not `GGML_NATIVE`: -march=native turns on
# AMX wherever the CPU flags advertise it, and on VMs that advertise AMX without running it a
# native build died with "Illegal instruction" on Q8_0. So each ISA extension is named from the
# flags, and AMX stays off.
_ISA_OPTIONS = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}


def build_options() -> list[str]:
    """CMake -D options for this CPU: its ISA extensions on, AMX off, native detection off."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    opts = ["-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF"]
    opts += [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _ISA_OPTIONS.items()]
    opts += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return opts


def build_server(jobs: int, targets: tuple[str, ...] = ("llama-server",)) -> Path:
    """Download the sdist, unpack it, build `targets` only (Release, `build_options()`);
    returns llama-server's path (the other targets land beside it)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    if not source_dir().is_dir():
        sdist = fetch_sdist()
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    src, build = source_dir(), source_dir() / "build"
    configure = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"]
    subprocess.run([*configure, *build_options()], check=True)
    target = ["cmake", "--build", str(build), "--target", *targets, "-j", str(jobs)]
    subprocess.run(target, check=True)
    return built_server()


def convert_f32(model_dir: Path, out: Path) -> Path:
    """The checkpoint as an f32 GGUF, with llama.cpp's own convert_hf_to_gguf.py (cached), past
    our random checkpoints' tokenizer (bench/llamacpp_convert.py says how)."""
    if out.is_file():
        return out
    from llamacpp_convert import convert  # noqa: PLC0415 (it imports this module)

    return convert(model_dir, out, "f32")


def server_command(server: Path, gguf: Path, port: int, threads: int, slots: int) -> list[str]:
    """The issue's llama-server settings: all threads, a 16k context split over `slots`."""
    return [
        str(server),
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(threads), "-c", str(512 * slots), "-np", str(slots)),
    ]
