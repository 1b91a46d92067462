"""Which attention setting and decode chunk a llama.cpp tower runs with, chosen by measurement.

On Hopper llama.cpp's int8 MMQ matmuls ran at a sixth of the card's bf16 rate (../shared/design/gpu.md),
and whether flash attention or a longer chunk pays depends on the weights' type and the device. So the
choice is data: ``MEASURED`` holds what the GPU check's kernel matrix timed (``scripts/gpu_rows.py``
``kernels``: 466 and 1,986 tokens, per weights type and device), and :func:`choose` replaces the default
setting with another only where that one was faster by more than ``NOISE`` at every length measured.
Until a GPU has measured, the table is empty and the defaults stand (``llama.ATTENTION_BY_WEIGHTS`` keeps
its exactness rule for f32 towers on the CPU either way: parity, not speed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from clef_gguf.core.limits import DECODE_CHUNK

DEFAULT = ("default", DECODE_CHUNK)  # (attention setting, tokens per llama_decode)
NOISE = 0.05  # a setting must win by more than this at every length to replace the default


@dataclass(frozen=True)
class Measured:
    """One timing of the kernel matrix: ``ms`` for ``tokens`` through the tower."""

    weights: str  # the tower file's type: q4_k_m, q8_0, bf16, f16 (llama.cpp's file type, lower case)
    device: str  # "gpu" or "cpu"
    attention: str  # a name of llama.ATTENTION
    n_batch: int
    tokens: int
    ms: float


@dataclass(frozen=True)
class Choice:
    attention: str
    n_batch: int
    gain: float  # the smallest speed-up over the default across the lengths measured (0: the default)


# What a GPU measured (the GPU check's ``kernels`` row prints these rows). Empty: no GPU has run it yet.
MEASURED: tuple[Measured, ...] = ()


def choose(measured: Iterable[Measured]) -> dict[tuple[str, str], Choice]:
    """(weights, device) -> the setting to run: the fastest that beat the default by more than ``NOISE``
    at every length where both were measured; pairs without a measured default are left out."""
    table: dict[tuple[str, str], dict[tuple[str, int], dict[int, float]]] = {}
    for m in measured:
        table.setdefault((m.weights.lower(), m.device), {}).setdefault((m.attention, m.n_batch), {})[m.tokens] = m.ms
    out = {}
    for key, settings in table.items():
        base = settings.get(DEFAULT)
        if not base:
            continue
        best = Choice(*DEFAULT, 0.0)
        for setting, times in settings.items():
            shared = set(times) & set(base)
            if setting == DEFAULT or shared != set(base):
                continue
            gain = min(base[n] / times[n] - 1 for n in shared)
            if gain > NOISE and gain > best.gain:
                best = Choice(setting[0], setting[1], round(gain, 3))
        out[key] = best
    return out


def setting_for(weights: str, device: str, measured: Iterable[Measured] | None = None) -> Choice:
    """The attention setting and chunk for a tower of ``weights`` on ``device`` ("gpu"/"cpu"), from
    ``measured`` (default: ``MEASURED``)."""
    return choose(MEASURED if measured is None else measured).get((weights.lower(), device), Choice(*DEFAULT, 0.0))
