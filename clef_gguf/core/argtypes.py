"""argparse value types shared by every command (a leaf module: the model files use it too).

A bad number is refused by argparse itself (exit 2, the flag named), before any model loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from clef_gguf.core.limits import MAX_MB

N = TypeVar("N", int, float)


def _number(text: str, parse: Callable[[str], N], expected: str) -> N:
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def _refuse(why: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(why)


def positive_int(text: str) -> int:
    """An integer >= 1 (threads, window sizes, counts)."""
    value = _number(text, int, "a whole number")
    if value < 1:
        raise _refuse(f"must be at least 1 (got {value})")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (seeds)."""
    value = _number(text, int, "a whole number")
    if value < 0:
        raise _refuse(f"must be at least 0 (got {value})")
    return value


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free one, where the command allows it)."""
    value = _number(text, int, "a port number")
    if not 0 <= value <= 65535:
        raise _refuse(f"must be a port number from 0 to 65535 (got {value})")
    return value


def megabytes(text: str) -> float:
    """A size in MiB >= 0 (0 turns a cache off)."""
    value = _number(text, float, "a size in MiB")
    if not 0 <= value < MAX_MB:  # also refuses nan and inf
        raise _refuse(f"must be a size in MiB >= 0 (got {text})")
    return value


def seconds(text: str) -> float:
    """A duration in seconds >= 0."""
    value = _number(text, float, "a number of seconds")
    if not 0 <= value < float("inf"):  # also refuses nan
        raise _refuse(f"must be >= 0 seconds (got {text})")
    return value


def fraction(text: str) -> float:
    """A share strictly between 0 and 1 (a held-out part of the records)."""
    value = _number(text, float, "a fraction")
    if not 0.0 < value < 1.0:  # also refuses nan
        raise _refuse(f"must lie strictly between 0 and 1 (got {text})")
    return value


def probability_gap(text: str) -> float:
    """A largest |difference| of two probabilities, 0 to 1 (0: the same bytes)."""
    value = _number(text, float, "a probability difference")
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise _refuse(f"must lie between 0 and 1 (got {text})")
    return value


def head_device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    value = text.strip().lower()
    kind, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return value
    raise _refuse(f"must be auto, cpu, cuda or cuda:N (got {text!r})")


def gpu_layers(text: str) -> int | str:
    """``auto`` (the device policy), ``all``, or a layer count >= 0."""
    if text in ("auto", "all"):
        return text
    value = _number(text, int, "auto, all or a layer count")
    if value < 0:
        raise _refuse(f"a layer count is >= 0 (got {value}); all layers: all")
    return value
