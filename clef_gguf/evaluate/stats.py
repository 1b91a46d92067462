"""How sure the numbers are: Wilson intervals for accuracy, and paired-bootstrap intervals for a
model's metric deltas to the reference on the same labelled questions (seeded: reproducible)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from clef_gguf.core.questions import winner
from clef_gguf.evaluate.metrics import ECE_BINS, NLL_FLOOR

Z95 = 1.959963984540054
BOOTSTRAP = 1000
# With no error among n auto-decided rows, the 95% upper bound of the error rate is about 3/n
# (the rule of three): fewer than 300 cannot tell a 0.99 precision from 0.98 or worse.
AUTO_DECIDE_MIN_N = {"0.99": 300, "0.95": 60}
DELTA_METRICS = ("accuracy", "nll", "brier", "ece")


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials ((nan, nan) for n = 0)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def auto_decide_note(block: dict[str, Any]) -> list[str]:
    """What the auto-decide numbers of a metrics block cannot tell with so few rows."""
    notes = []
    n = block.get("n", 0)
    for target, minimum in AUTO_DECIDE_MIN_N.items():
        if n and n < minimum:
            notes.append(f"n = {n} < {minimum}: auto-decide coverage at {target} precision is "
                         "noise (with no error among n rows the error rate can still be ~3/n)")
    return notes


class Rows:
    """Per-row arrays of one model's labelled rows, in a given order."""

    def __init__(self, rows: Sequence[dict[str, Any]]) -> None:
        probs = [np.asarray(r["probs"], dtype=np.float64) for r in rows]
        targets = [int(r["target"]) for r in rows]
        self.correct = np.array([winner(p) == t for p, t in zip(probs, targets)], dtype=np.float64)
        self.confidence = np.array([float(p.max()) for p in probs])
        self.nll = np.array([-math.log(max(float(p[t]), NLL_FLOOR)) for p, t in zip(probs, targets)])
        self.brier = np.array([float(np.sum((p - np.eye(len(p))[t]) ** 2)) for p, t in zip(probs, targets)])

    def metrics(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Each metric over every resample: ``idx`` is [resamples, n] row indices."""
        return {"accuracy": self.correct[idx].mean(axis=1), "nll": self.nll[idx].mean(axis=1),
                "brier": self.brier[idx].mean(axis=1), "ece": self._ece(idx)}

    def _ece(self, idx: np.ndarray) -> np.ndarray:
        conf, ok = self.confidence[idx], self.correct[idx]
        bins = np.minimum((conf * ECE_BINS).astype(np.int64), ECE_BINS - 1)
        n = idx.shape[1]
        total = np.zeros(idx.shape[0])
        for b in range(ECE_BINS):
            inside = bins == b
            count = inside.sum(axis=1)
            gap = np.abs((conf * inside).sum(axis=1) - (ok * inside).sum(axis=1))
            total += np.where(count > 0, gap / n, 0.0)
        return total


def key(row: dict[str, Any]) -> tuple[int, str]:
    """Rows of two models pair up by line number and question id (``prediction_rows(...,
    keep_line=True)``)."""
    return (row["line"], row["question_id"])


def paired_deltas(reference: Sequence[dict[str, Any]], model: Sequence[dict[str, Any]], *,
                  seed: int = 0, resamples: int = BOOTSTRAP) -> dict[str, Any]:
    """Each metric's model - reference delta on the rows both have, with the 2.5 and 97.5
    percentiles of the same resamples of rows for both (paired), and whether 0 lies outside."""
    theirs = {key(r): r for r in model}
    both = [(r, theirs[key(r)]) for r in reference if key(r) in theirs]
    if not both:
        return {"n": 0}
    ref, mod = Rows([a for a, _ in both]), Rows([b for _, b in both])
    n = len(both)
    everything = np.arange(n)[None, :]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    point_ref, point_mod = ref.metrics(everything), mod.metrics(everything)
    boot_ref, boot_mod = ref.metrics(idx), mod.metrics(idx)
    out: dict[str, Any] = {"n": n, "seed": seed, "resamples": resamples}
    for name in DELTA_METRICS:
        deltas = boot_mod[name] - boot_ref[name]
        lo, hi = (float(v) for v in np.percentile(deltas, [2.5, 97.5]))
        out[name] = {"reference": float(point_ref[name][0]), "model": float(point_mod[name][0]),
                     "delta": float(point_mod[name][0] - point_ref[name][0]), "ci95": [lo, hi],
                     "significant": not lo <= 0.0 <= hi}
    return out
