"""argparse value types shared by every command (a leaf module: the model files use it too).

A bad number is refused by argparse itself (exit 2, the flag named), before any model loads.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (threads, window sizes, counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def megabytes(text: str) -> float:
    """A size in MiB >= 0 (0 turns a cache off)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in MiB, got {text!r}") from None
    if not 0 <= value < 1 << 30:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be a size in MiB >= 0 (got {text})")
    return value


def seconds(text: str) -> float:
    """A duration in seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds (got {text})")
    return value


def gpu_layers(text: str) -> int | str:
    """``auto`` (the device policy), ``all``, or a layer count >= 0."""
    if text in ("auto", "all"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, all or a layer count, got {text!r}") \
            from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a layer count is >= 0 (got {value}); all layers: all")
    return value
