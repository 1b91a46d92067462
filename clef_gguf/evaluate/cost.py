"""What a model costs on this machine, measured while eval runs it: file size, peak resident
memory, load time, records/s and tokens/s (the rates count from the end of the load)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

SAMPLE_S = 0.02


@dataclass
class Cost:
    tower_bytes: int
    files_bytes: int
    peak_rss_bytes: int
    load_s: float
    run_s: float
    records: int  # computed in this run (a resumed run counts only what it computed)
    tokens: int

    @property
    def records_per_s(self) -> float:
        return self.records / self.run_s if self.run_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.run_s if self.run_s > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"records_per_s": self.records_per_s,
                               "tokens_per_s": self.tokens_per_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cost:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def file_bytes(paths: list[Path]) -> int:
    """Bytes of the files (a checkpoint's directory counts every file in it)."""
    total = 0
    for path in paths:
        if path.is_dir():
            total += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        elif path.exists():
            total += path.stat().st_size
    return total


class PeakRss:
    """The largest resident set size of this process while the block runs, sampled every
    ``SAMPLE_S`` seconds by a daemon thread (the kernel's own peak never goes down, so it could
    not tell the second model of a run from the first)."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="clef-peak-rss")
        self.peak = self._process.memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
