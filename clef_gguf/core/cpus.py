"""How many CPU threads this process may use: the default of the tower and the quantizer."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """The cores this process is allowed to run on (a cgroup or taskset limit counts), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
