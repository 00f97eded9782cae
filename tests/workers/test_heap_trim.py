"""`heap_trimmer` gives freed C-heap pages back to the OS (workers/heap_trim.py): measured in a
fresh process, where 128 MB of small malloc blocks are freed behind one kept block, so glibc's
own top-of-heap trim cannot return them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_MEASURE = """
import ctypes, sys
from workers.heap_trim import heap_trimmer
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def anon():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
blocks = [libc.malloc(64 << 10) for _ in range(2048)]  # below the mmap threshold: the heap
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
keep = libc.malloc(64 << 10)  # above them all: the heap's top stays in use
for b in blocks:
    libc.free(b)
held = anon()
if sys.argv[1] == "trim":
    heap_trimmer()()
print(held - anon())
"""


def _released(mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_ARENA_MAX": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, mode],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return int(out.stdout)


def test_trimming_returns_the_freed_heap_and_nothing_returns_it_alone() -> None:
    assert _released("keep") < 8 << 20  # glibc alone keeps the freed blocks
    assert _released("trim") > 100 << 20
