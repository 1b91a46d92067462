"""The machine's load while the speed probe runs (how many cores other processes kept busy), and the
measurements a busy machine spoils (out of line with their kernel group).

A probe that shares the cores with a build measures the build too: on a 2-core machine, one taken
while a compile held both cores put Q5_K_S at 4x Q5_K_M (they are within a few percent on a quiet
one). The probe's own work is its child process (and the quantizer that child starts); everything
else the system's CPU counters saw in the same window is someone else's. Only the part that overlaps
the cores the probe uses slows it: with ``--threads 1`` on 2 cores, one busy core is no contention.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import psutil

# Other processes' cores, beyond the cores the probe leaves free, above which a window counts as
# under load. A quarter of a core: a browser tab's idle churn stays under it, a compile does not.
LOADED_CORES = 0.25
QUIET_SAMPLE_S = 0.5  # how long ``contention_now`` watches the machine
# Types whose matmuls take the same kind of CPU kernel (ggml's per-block dot products): within a group a
# quant's time follows its bytes within a few percent (the ~110M table in docs/models.md: every K-quant
# 230-255 ms, every IQ1-IQ3/IQ4_XS 228-252), across groups it does not (Q5_1 2.9x Q4_K_M). Absent: a
# K-quant is "k", another IQ type "iq", anything else its own group.
# The two NVFP4 GGUFs hold the same tensor types (off Blackwell, the same 8-bit-activation dot products).
KERNEL_GROUPS = {"Q4_0": "q_0", "Q5_0": "q_0", "Q8_0": "q_0", "IQ4_NL": "q_0", "Q4_1": "q_1", "Q5_1": "q_1",
                 "NVFP4A16-GGUF": "nvfp4", "NVFP4-GGUF": "nvfp4"}
# A quant this many times its group's median (the others') is out of line: measured again. On a probe
# taken while a build held both cores, Q5_K_S read 4.3x Q5_K_M.
OUT_OF_LINE = 1.5


def _busy_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (every core, every process)."""
    t = psutil.cpu_times()
    # Linux counts guest time in user time too; idle and iowait are not busy
    return sum(t) - t.idle - sum(getattr(t, name, 0.0) for name in ("iowait", "guest", "guest_nice"))


def _own_seconds(process: psutil.Process, waited: bool = True) -> float:
    """CPU seconds of ``process`` (and of the children it has waited for, with ``waited``). An exited
    child that was not waited for yet still has them (a zombie's counters)."""
    try:
        t = process.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system + ((t.children_user + t.children_system) if waited else 0.0)


def contended_cores(others: float, threads: int, cores: int | None = None) -> float:
    """Cores' worth of other work on the cores a ``threads``-thread probe uses: ``others`` less the
    cores it leaves free."""
    spare = max(0, (cores or psutil.cpu_count() or 1) - threads)
    return max(0.0, others - spare)


@dataclass(frozen=True)
class Window:
    """What other processes did while one stretch of the probe ran."""

    seconds: float
    others: float  # cores' worth of busy time that was not the probe's (machine busy - probe - pick)
    contended: float  # the part of it on the probe's cores (``contended_cores``)

    @property
    def loaded(self) -> bool:
        return self.contended > LOADED_CORES

    def to_dict(self) -> dict[str, float]:
        return {"seconds": round(self.seconds, 2), "other_cores": round(self.others, 2),
                "contended_cores": round(self.contended, 2)}


class Meter:
    """Measures :class:`Window` s of a running child process, one per :meth:`lap`."""

    def __init__(self, child_pid: int, threads: int):
        self.threads = threads
        self._me = psutil.Process()
        try:
            self._child: psutil.Process | None = psutil.Process(child_pid)
        except psutil.Error:
            self._child = None
        self._mark = self._read()

    def _read(self) -> tuple[float, float, float]:
        """(now, the machine's busy seconds, the probe's and pick's own): the child, the children it
        waited for, and those still running (the quantizer it starts for a small tower)."""
        own = _own_seconds(self._me, waited=False)  # pick itself; its child is counted once, below
        if self._child is not None:
            own += _own_seconds(self._child)
            try:
                own += sum(_own_seconds(p) for p in self._child.children(recursive=True))
            except psutil.Error:
                pass
        return time.monotonic(), _busy_seconds(), own

    def lap(self) -> Window:
        """The window since the last lap (or the start)."""
        now = self._read()
        (t0, busy0, own0), (t1, busy1, own1) = self._mark, now
        self._mark = now
        seconds = max(t1 - t0, 1e-6)
        others = max(0.0, (busy1 - busy0) - max(0.0, own1 - own0)) / seconds
        return Window(seconds, others, contended_cores(others, self.threads))


def contention_now(threads: int, sample: float = QUIET_SAMPLE_S) -> float:
    """Cores' worth of other work on the cores a ``threads``-thread probe would use, watched for
    ``sample`` seconds now (this process is idle meanwhile)."""
    me = psutil.Process()
    t0, busy0, own0 = time.monotonic(), _busy_seconds(), _own_seconds(me, waited=False)
    time.sleep(sample)
    seconds = time.monotonic() - t0
    others = max(0.0, (_busy_seconds() - busy0) - (_own_seconds(me, waited=False) - own0)) / seconds
    return contended_cores(others, threads)


def kernel_group(quant: str) -> str:
    """The kind of CPU kernel ``quant``'s matmuls take (``KERNEL_GROUPS``)."""
    q = quant.upper()
    return KERNEL_GROUPS.get(q) or ("k" if "_K" in q else "iq" if q.startswith("IQ") else q)


def out_of_line(seconds: dict[str, float]) -> set[str]:
    """Quants more than ``OUT_OF_LINE`` times the median of the others of their kernel group."""
    groups: dict[str, list[str]] = {}
    for q in seconds:
        groups.setdefault(kernel_group(q), []).append(q)
    out = set()
    for members in groups.values():
        for q in members:
            others = [seconds[o] for o in members if o != q]
            if others and seconds[q] > OUT_OF_LINE * statistics.median(others):
                out.add(q)
    return out


def _pace(row: dict) -> float:
    """Seconds per token of a measurement's fastest run."""
    return min(row["probe_runs"]) / row["probe_tokens"]


def kept(first: dict, again: dict | None) -> dict:
    """Of two measurements of one quant (``speed_run``'s rows with their window's ``loaded``), the one
    taken without load, else the faster."""
    if again is None or "error" in again:
        return first
    if "error" in first:
        return {**again, "remeasured": True}
    best = min((first, again), key=lambda r: (r["loaded"], _pace(r)))
    return {**best, "remeasured": True}
