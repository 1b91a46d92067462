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
