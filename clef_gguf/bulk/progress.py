"""Progress and the final summary of a batch job, on stderr.

A terminal gets a tqdm bar (records, records/s, tokens/s, ETA); a log file or a pipe gets one
plain line every ``log_every`` seconds instead, since a bar's carriage returns would fill it with
thousands of overwritten lines.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import TextIO

PREFIX = "clef-gguf batch"


class Progress:
    def __init__(self, total: int, *, skipped: int = 0, log_every: float = 10.0,
                 stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.total, self.skipped, self.log_every = total, skipped, log_every
        self.stream = stream or sys.stderr
        self.answered, self.tokens = 0, 0
        self.failed: Counter[str] = Counter()
        self.started = time.monotonic()
        self.ready_at: float | None = None  # the model is loaded: the rates count from here
        self._last_log = self.started
        is_tty = self.stream.isatty() if tty is None else tty
        self._bar = None
        if is_tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="rec", file=self.stream, desc=PREFIX,
                             dynamic_ncols=True, smoothing=0.1)

    @property
    def done(self) -> int:
        return self.answered + sum(self.failed.values())

    def update(self, record: dict) -> None:
        """Count one written output record."""
        if "error" in record:
            self.failed[str(record["error"].get("code"))] += 1
        else:
            self.answered += 1
            self.tokens += int(record.get("usage", {}).get("input_tokens", 0))
        now = time.monotonic()
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tokens / max(now - self.started, 1e-9):,.0f} tok/s",
                                      refresh=False)
            self._bar.update(1)
        elif now - self._last_log >= self.log_every:
            self._last_log = now
            self._line(self._status(now))

    def ready(self) -> None:
        """The model is loaded: what follows is the rate the rest of the job will go at."""
        self.ready_at = self._last_log = time.monotonic()
        if self._bar is not None and self.done == 0:
            self._bar.reset(total=self.total)  # tqdm's clock too: its rate and ETA

    def rate(self, now: float) -> float:
        """Records/s since the model was ready (the load says nothing about the rest's pace)."""
        since = self.started if self.ready_at is None else self.ready_at
        return self.done / (now - since) if now > since else 0.0

    def _status(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.rate(now)
        eta = (self.total - self.done) / rate if rate else float("inf")
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return (f"{self.done}/{self.total} records{share}, {sum(self.failed.values())} failed, "
                f"{rate:.1f} records/s, {self.tokens / elapsed:,.0f} tokens/s, "
                f"ETA {_duration(eta)}")

    def _line(self, text: str) -> None:
        print(f"{PREFIX}: {text}", file=self.stream, flush=True)

    def summary(self, interrupted: str | None = None) -> str:
        """The closing line; ``interrupted`` names the signal that stopped the job."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        now = time.monotonic()
        elapsed = now - self.started
        failed = sum(self.failed.values())
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(self.failed.items()))
        text = (f"{self.answered} answered, {failed} failed" + (f" ({codes})" if codes else "")
                + f", {self.skipped} already done; {self.tokens:,} tokens in {elapsed:.1f} s: "
                f"{self.done / elapsed if elapsed else 0:.1f} records/s, "
                f"{self.tokens / elapsed if elapsed else 0:,.0f} tokens/s")
        if self.ready_at is not None:
            text += (f" ({self.rate(now):.1f} records/s after the model load, "
                     f"{self.ready_at - self.started:.1f} s)")
        if interrupted:
            left = self.total - self.done
            text += (f"; stopped by {interrupted} with {left} records left: run the same "
                     "command again to resume")
        self._line(text)
        return text


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    seconds = int(seconds + 0.5)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
