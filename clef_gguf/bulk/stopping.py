"""Ctrl-C and SIGTERM in a batch job: stop computing at once, but never in the middle of
writing a record, so the output keeps every record written and no half of one.

The first signal raises ``Interrupted`` in the main thread (at once while the model computes,
after the write while a record is being written); the default handlers come back with it, so a
second Ctrl-C forces the exit while the job is still tidying up (nothing written is lost then
either: the journal is on disk).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What signal.signal takes and returns: a function, SIG_DFL/SIG_IGN, or None (a handler not set from
# Python).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Interrupted(BaseException):
    """Not an ``Exception``: no ``except Exception`` on the way up may swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class Stopper:
    def __init__(self) -> None:
        self.received: int | None = None
        self._writing = False
        self._previous: dict[int, Handler] = {}

    def install(self) -> None:
        """(Re)install the handlers; Ray's ``init`` replaces SIGTERM's with its own."""
        for sig in SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum
        self.restore()
        if not self._writing:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A section a signal does not cut: it takes effect when the section ends."""
        self._writing = True
        try:
            yield
        finally:
            self._writing = False
        if self.received is not None:
            raise Interrupted(self.received)

    def __enter__(self) -> Stopper:
        self.install()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.restore()
