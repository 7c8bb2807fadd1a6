"""Start-up time as users wait on it: from the process's start to "ready", split into the phases that
take it (loading the weights, allocating the cache, capturing graphs) and the rest."""

from __future__ import annotations

import os
import time

_IMPORTED = time.time()  # the fallback where /proc is missing: close to the start of a `hyserve` process


def process_start_time() -> float:
    """This process's start as a time.time() value: /proc/self/stat's start tick against /proc/uptime
    (10 ms resolution); the import time of this module where those are not readable."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


class StartupClock:
    """`lap(name)` after each phase: the time since the previous lap is added to `name` (None: other)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.start = self.last = clock()
        self.phases: dict[str, float] = {}

    def elapsed(self) -> float:
        return self.clock() - self.start

    def lap(self, name: str | None = None) -> None:
        now = self.clock()
        if name is not None:
            self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now


def describe_startup(total: float, phases: dict[str, float], origin: str = "process start") -> str:
    """"ready 47.3 s after process start (load 30.2 s, cache allocation 1.1 s, ..., other 4.0 s)"."""
    parts = [f"{name} {s:.1f} s" for name, s in phases.items()]
    parts.append(f"other {max(0.0, total - sum(phases.values())):.1f} s")
    return f"ready {total:.1f} s after {origin} ({', '.join(parts)})"


def since_process_start() -> float:
    return time.time() - process_start_time()
