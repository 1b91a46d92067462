"""How busy the machine is beside a measurement: the one measure of "busy" for everything that times
(``pick``'s speed probe, ``tune``).

A measurement that shares the cores with a build measures the build too: quants that time within a
few percent of each other on a quiet machine read several times apart, and ``tune`` would keep a value
that only won because another process held the cores (the cases: docs/models.md, "A busy machine").
What is measured is the work of some processes (a child and its children, or this process); everything
else the system's CPU counters saw in the same window is someone else's. Only the part that overlaps the
cores the measurement uses slows it: with one thread on 2 cores, one busy core is no contention.

Callers take windows with :class:`Meter` (``contention_now`` is one window of an idle wait). Tests that
check what a caller does with a busy or quiet machine replace ``Meter`` with a fake; nothing else here
reads the machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil

# Other processes' cores, beyond the cores the measurement leaves free, above which a window counts as
# under load. A quarter of a core: a browser tab's idle churn stays under it, a compile does not.
LOADED_CORES = 0.25
QUIET_SAMPLE_S = 0.5  # how long ``contention_now`` watches the machine


def busy_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (every core, every process)."""
    t = psutil.cpu_times()
    # Linux counts guest time in user time too; idle and iowait are not busy
    return sum(t) - t.idle - sum(getattr(t, name, 0.0) for name in ("iowait", "guest", "guest_nice"))


def own_seconds(process: psutil.Process, waited: bool = True) -> float:
    """CPU seconds of ``process`` (and of the children it has waited for, with ``waited``). An exited
    child that was not waited for yet still has them (a zombie's counters)."""
    try:
        t = process.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system + ((t.children_user + t.children_system) if waited else 0.0)


def contended_cores(others: float, threads: int, cores: int | None = None) -> float:
    """Cores' worth of other work on the cores a ``threads``-thread measurement uses: ``others`` less the
    cores it leaves free."""
    spare = max(0, (cores or psutil.cpu_count() or 1) - threads)
    return max(0.0, others - spare)


@dataclass(frozen=True)
class Window:
    """What the measured processes and the others did during one stretch of a measurement."""

    seconds: float
    others: float  # cores' worth of busy time that was not the measured processes'
    contended: float  # the part of it on the measurement's cores (``contended_cores``)
    own: float = 0.0  # cores' worth of the measured processes' own work

    @property
    def loaded(self) -> bool:
        return self.contended > LOADED_CORES

    def to_dict(self) -> dict[str, float]:
        return {"seconds": round(self.seconds, 2), "other_cores": round(self.others, 2),
                "contended_cores": round(self.contended, 2)}


def worst(windows: list[Window]) -> Window | None:
    """The most contended of ``windows`` (None when there are none): a run is as loaded as its worst part."""
    return max(windows, key=lambda w: w.contended, default=None)


class Meter:
    """Windows (:meth:`lap`) of the machine's load beside the measured work: this process's own, and with
    ``pid`` that child's and its children's too (the speed probe's child and the quantizer it starts)."""

    def __init__(self, threads: int, pid: int | None = None):
        self.threads = threads
        self._me = psutil.Process()
        self._child: psutil.Process | None = None
        if pid is not None:
            try:
                self._child = psutil.Process(pid)
            except psutil.Error:
                pass
        self._mark = self._read()

    def _read(self) -> tuple[float, float, float]:
        """(now, the machine's busy seconds, the measured processes' own)."""
        own = own_seconds(self._me, waited=False)  # a child is counted once, below
        if self._child is not None:
            own += own_seconds(self._child)
            try:
                own += sum(own_seconds(p) for p in self._child.children(recursive=True))
            except psutil.Error:
                pass
        return time.monotonic(), busy_seconds(), own

    def lap(self) -> Window:
        """The window since the last lap (or the start)."""
        now = self._read()
        (t0, busy0, own0), (t1, busy1, own1) = self._mark, now
        self._mark = now
        seconds = max(t1 - t0, 1e-6)
        own = max(0.0, own1 - own0)
        others = max(0.0, (busy1 - busy0) - own) / seconds
        return Window(seconds, others, contended_cores(others, self.threads), own / seconds)


def contention_now(threads: int, sample: float = QUIET_SAMPLE_S) -> float:
    """Cores' worth of other work on the cores a ``threads``-thread measurement would use, watched for
    ``sample`` seconds now (this process is idle meanwhile)."""
    meter = Meter(threads)
    time.sleep(sample)
    return meter.lap().contended
