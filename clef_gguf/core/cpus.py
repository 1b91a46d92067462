"""CPU threads: how many this process may use (the default of the tower and the quantizer), the one
check of a thread count a user gives, and the one place torch's intra-op pool is sized."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from clef_gguf.core.errors import InvalidSetting


def available_cpus() -> int:
    """The cores this process is allowed to run on (a cgroup or taskset limit counts), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def check_threads(value: Any, field: str = "threads") -> int | None:
    """``value`` if it is None (the default: every available core) or a whole number >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidSetting(f"{field} must be a whole number >= 1 (got {value!r})", field=field)
    return value


def set_torch_threads(n: int) -> None:
    """Size torch's intra-op pool (process-wide: torch has one), for the head or the NVFP4 tower that
    run after llama.cpp on the same cores instead of torch's default of every core."""
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's pool at ``n`` threads for a block (None: as it is), put back after it."""
    import torch

    before = torch.get_num_threads()
    if n:
        set_torch_threads(n)
    try:
        yield
    finally:
        set_torch_threads(before)
