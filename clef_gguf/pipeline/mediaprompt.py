"""What a prompt with images or videos carries from the encoder to the tower.

Each image (and each temporal pair of a video's frames) becomes a run of ``t·h·w / merge²`` pad
tokens in the prompt; the tower decodes those runs as the vision tower's embeddings instead of token
embeddings. Every token gets a 3-section M-RoPE position (t, h, w), as the reference's
``get_rope_index``: text tokens share one position in all sections and advance by one; a run starting
at position p places its token at (row, col) of its merged grid at (p, p + row, p + col), and the
position then advances by the run's extent, max(h, w), not by its token count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Run:
    """One image, or one temporal pair of a video's frames, in the prompt: its tokens
    ``[start, end)`` and its merged grid (``rows`` x ``cols`` tokens)."""

    start: int
    end: int
    rows: int
    cols: int

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


def positions(n_tokens: int, runs: Sequence[Run]) -> np.ndarray:
    """int32 [3, n_tokens]: the (t, h, w) M-RoPE position of every token (module docstring)."""
    out = np.empty((3, n_tokens), dtype=np.int32)
    at = p = 0
    for run in sorted(runs, key=lambda r: r.start):
        text = run.start - at
        out[:, at:run.start] = p + np.arange(text, dtype=np.int32)
        p += text
        row, col = np.divmod(np.arange(run.n_tokens, dtype=np.int32), run.cols)
        out[0, run.start:run.end] = p
        out[1, run.start:run.end] = p + row
        out[2, run.start:run.end] = p + col
        p += max(run.rows, run.cols)
        at = run.end
    out[:, at:] = p + np.arange(n_tokens - at, dtype=np.int32)
    return out


@dataclass(frozen=True)
class MediaRows:
    """The embeddings of a prompt's runs, and how many of them the vision cache held."""

    rows: np.ndarray  # float32 [sum of run lengths, n_embd], runs in order
    cached_tokens: int  # rows taken from the vision cache instead of computed


@dataclass
class MediaPrompt:
    """The media of one encoded prompt. ``embed()`` runs the vision tower on first use only, so a
    prompt whose ``[prefix][state]`` the state cache holds (keyed by ``digest``) never runs it."""

    runs: tuple[Run, ...]
    positions: np.ndarray  # int32 [3, T]
    digest: str  # sha256 of the media's pixels, grids and processing: part of the cache keys
    compute: Callable[[], MediaRows]
    _done: MediaRows | None = field(default=None, repr=False)
    # ms this prompt spent in the vision tower (or its cache): 0 until embed() runs, and when the
    # state cache held the prompt's media. Part of the tower's time; reported on its own too.
    vision_ms: float = 0.0

    def embed(self) -> np.ndarray:
        if self._done is None:
            started = time.perf_counter()
            self._done = self.compute()
            self.vision_ms = round((time.perf_counter() - started) * 1e3, 3)
        return self._done.rows

    @property
    def n_tokens(self) -> int:
        return sum(run.n_tokens for run in self.runs)

    @property
    def cached_tokens(self) -> int:
        """Media tokens whose embeddings this prompt did not compute, once the tower has run: all of
        them when the decode never needed them (their state restored from the state cache), else
        those the vision cache held (``usage.cached_media_tokens`` when not 0)."""
        return self.n_tokens if self._done is None else self._done.cached_tokens

    def pieces(self, begin: int, end: int) -> list[tuple[int, int, int | None]]:
        """``[begin, end)`` split at the runs: ``(start, stop, offset)`` where ``offset`` is the
        first embedding row of a media piece and None for text."""
        out: list[tuple[int, int, int | None]] = []
        offset, at = 0, begin
        for run in self.runs:
            if run.end <= at:
                offset += run.n_tokens
                continue
            if run.start >= end:
                break
            if run.start > at:
                out.append((at, run.start, None))
                at = run.start
            stop = min(run.end, end)
            out.append((at, stop, offset + at - run.start))
            offset += run.n_tokens
            at = stop
        if at < end:
            out.append((at, end, None))
        return out
