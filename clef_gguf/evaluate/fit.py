"""Fitting one temperature per question type and option-count band.

Each item is one question's raw logits ``z`` with either its label (minimise the NLL of
``softmax(z / T)``) or a reference's probabilities ``p`` (minimise KL(p ‖ softmax(z / T)), so a
quant's probabilities match the full-precision model's). Both are convex in β = 1/T, so a golden
section search over β finds the one minimum. A band with fewer than ``MIN_QUESTIONS`` items takes
its type's temperature, a type with fewer takes 1.0; the table says which (``source``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clef_gguf.formats import calibration as cal
from clef_gguf.core.questions import QUESTION_TYPES, TYPES, question_type

BOUNDS = (0.25, 8.0)  # the temperatures a fit may return
MIN_QUESTIONS = 30  # items a band (or a type) needs for a temperature of its own
ITERATIONS = 80
# Each type's option-count bands: a type with fixed options has one count, so one band; the others all.
BANDS_OF = {t.name: (cal.band(len(t.fixed)),) if t.fixed else tuple(b for _, b in cal.BANDS) for t in TYPES}


@dataclass(frozen=True)
class Item:
    type: str
    logits: np.ndarray  # float64 [k]
    target: int | None = None  # label mode
    reference: np.ndarray | None = None  # KL mode: the reference's probabilities [k]

    def __post_init__(self) -> None:
        question_type(self.type, field="type")  # InvalidQuestionType for a type nobody registered

    @property
    def key(self) -> str:
        return cal.key(self.type, len(self.logits))


def _padded(items: Sequence[Item]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(i.logits) for i in items)
    z = np.full((len(items), width), -np.inf)
    mask = np.zeros((len(items), width), dtype=bool)
    for row, item in enumerate(items):
        z[row, :len(item.logits)] = item.logits
        mask[row, :len(item.logits)] = True
    return z, mask


def _log_softmax(z: np.ndarray, beta: float) -> np.ndarray:
    x = beta * z
    top = np.max(x, axis=1, keepdims=True)
    return x - top - np.log(np.sum(np.exp(x - top), axis=1, keepdims=True))


class Objective:
    """Mean NLL (label mode) or mean KL (reference mode) of ``items`` as a function of T."""

    def __init__(self, items: Sequence[Item]) -> None:
        self.z, self.mask = _padded(items)
        self.kl = items[0].target is None
        if self.kl:
            p = np.zeros_like(self.z)
            for row, item in enumerate(items):
                assert item.reference is not None
                p[row, :len(item.logits)] = np.clip(item.reference, 1e-12, None)
            self.p = p
            self.entropy = np.sum(np.where(self.mask, p * np.log(np.where(self.mask, p, 1.0)), 0.0), axis=1)
        else:
            self.targets = np.array([item.target for item in items])

    def __call__(self, temperature: float) -> float:
        logq = _log_softmax(self.z, 1.0 / temperature)
        if self.kl:
            cross = np.sum(np.where(self.mask, self.p * np.where(self.mask, logq, 0.0), 0.0), axis=1)
            return float(np.mean(self.entropy - cross))
        picked = logq[np.arange(len(self.targets)), self.targets]
        return float(np.mean(-np.maximum(picked, math.log(1e-12))))


def fit_temperature(items: Sequence[Item], bounds: tuple[float, float] = BOUNDS) -> float:
    """The T in ``bounds`` that minimises the objective (golden section over β = 1/T)."""
    objective = Objective(items)
    lo, hi = 1.0 / bounds[1], 1.0 / bounds[0]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = objective(1.0 / a), objective(1.0 / b)
    for _ in range(ITERATIONS):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = objective(1.0 / a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = objective(1.0 / b)
    return 1.0 / ((lo + hi) / 2)


def fit_table(items: Sequence[Item], min_questions: int = MIN_QUESTIONS) -> dict[str, dict]:
    """``{"<type>": entry, "<type>.<band>": entry}`` for every type and band, each
    ``{"temperature", "source": "band" | "type" | "default", "n"}`` (n: items it was fitted on)."""
    table: dict[str, dict] = {}
    for qtype in QUESTION_TYPES:
        of_type = [i for i in items if i.type == qtype]
        if len(of_type) >= min_questions:
            table[qtype] = {"temperature": fit_temperature(of_type), "source": "type", "n": len(of_type)}
        else:
            table[qtype] = {"temperature": 1.0, "source": "default", "n": len(of_type)}
        for band in BANDS_OF[qtype]:
            name = f"{qtype}.{band}"
            of_band = [i for i in of_type if i.key == name]
            if len(of_band) >= min_questions:
                table[name] = {"temperature": fit_temperature(of_band), "source": "band",
                               "n": len(of_band)}
            else:
                table[name] = dict(table[qtype], n=len(of_band))
    return table
