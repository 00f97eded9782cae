"""Give the C heap's free pages back to the OS when a serving process goes idle.

Why: torch's CPU allocator takes a step's activations from glibc malloc, and glibc keeps what
they free (its mmap threshold grows to 32 MB after the first large free, so later large blocks
come from the heap and stay there). In the engine core serving the LFM2-350M shape that was
55-60 MB of free heap kept after a batch (docs/serving_path.md, "Memory"). `malloc_trim(0)`
returns every free whole page (glibc 2.8+ releases pages inside the heap too, not only its top)
and costs a few milliseconds, so it runs on going idle, never per step.

Where the C library has no `malloc_trim` (musl, macOS) there is nothing to trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _nothing() -> None:
    return None


def heap_trimmer() -> Callable[[], None]:
    """A callable that returns the C heap's free pages to the OS (bound once: the symbol is
    looked up here, not at every call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return _nothing
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

    def release() -> None:
        trim(0)

    return release
