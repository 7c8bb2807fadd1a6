"""This process's resident host memory, from /proc/self (Linux), for the loader's start-up report.

The peak (VmHWM) can be reset to the current size by writing "5" to /proc/self/clear_refs (Linux 4.0+),
so the peak of one phase, such as loading the weights, can be read on its own. Elsewhere every function
answers None (or False) and the report leaves the numbers out.
"""

from __future__ import annotations


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    """Resident set size now: anonymous memory plus the file pages this process has mapped in."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int | None:
    """The resident set's high-water mark since the process started or the last `reset_peak_rss()`."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Set the high-water mark to the current resident size; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
