"""Start-up accounting of one process (a replica or a TP rank): how long each phase took, how
long the process lived before it (Ray's worker start and the imports), and its resident memory.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from shortconv.engine.stats import StartupReport


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_age_s() -> float:
    """Seconds since this process started (0.0 where /proc does not say)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


@dataclass
class PhaseClock:
    """Times named phases in order: `with clock.phase("weights"): ...`."""

    before_s: float = field(default_factory=process_age_s)
    phases: list[tuple[str, float]] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases.append((name, time.perf_counter() - t0))

    def add(self, phases: dict[str, float]) -> None:
        self.phases.extend(phases.items())

    def report(self, who: str) -> StartupReport:
        return StartupReport(who, self.before_s, tuple(self.phases), rss_bytes())
