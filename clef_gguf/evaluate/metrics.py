"""clef-finetune 0.1.0's metrics (``clef_finetune.metrics.summarize``), number for number.

Rows are ``{"record_id", "question_id", "type", "option_ids", "probs", "target"}``. Each block
holds ``n``, ``accuracy``, ``nll`` (the target's probability clipped at 1e-12), ``brier``
(multiclass: the sum over options), ``ece`` (top-label, 10 equal-width bins), ``macro_f1`` (only
when every row of the block has the same option count; over the classes that occur) and
``auto_decide`` (the largest share of rows decided at a confidence threshold while precision
stays at 0.99 / 0.95). The arithmetic runs in the same order as clef-finetune's, in Python
floats, so the numbers are equal and a user can diff ours against theirs. The predicted option is
``core.questions.winner`` over the row's options in prompt order (clef-finetune's), so an exact tie
goes to the first option in prompt order where the answer names the first in request order: a
choice's ``option_ids`` are sorted, its report order is the request's. ``per_type`` and the
reliability table are this project's additions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from clef_gguf.core.questions import winner

TARGET_PRECISIONS = (0.99, 0.95)
ECE_BINS = 10
NLL_FLOOR = 1e-12

Probs = Sequence[Sequence[float]]


def accuracy(preds: Sequence[int], targets: Sequence[int]) -> float:
    return sum(p == t for p, t in zip(preds, targets)) / len(targets) if targets else float("nan")


def macro_f1(preds: Sequence[int], targets: Sequence[int], n_classes: int) -> float:
    f1s = []
    for c in range(n_classes):
        tp = sum(p == c and t == c for p, t in zip(preds, targets))
        fp = sum(p == c and t != c for p, t in zip(preds, targets))
        fn = sum(p != c and t == c for p, t in zip(preds, targets))
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    return sum(f1s) / len(f1s) if f1s else float("nan")


def nll(probs: Probs, targets: Sequence[int]) -> float:
    return sum(-math.log(max(p[t], NLL_FLOOR)) for p, t in zip(probs, targets)) / len(targets)


def brier(probs: Probs, targets: Sequence[int]) -> float:
    total = 0.0
    for p, t in zip(probs, targets):
        total += sum((pi - (1.0 if i == t else 0.0)) ** 2 for i, pi in enumerate(p))
    return total / len(targets)


def _bin(confidence: float, n_bins: int) -> int:
    return min(int(confidence * n_bins), n_bins - 1)


def ece(probs: Probs, targets: Sequence[int], n_bins: int = ECE_BINS) -> float:
    """Top-label expected calibration error, equal-width bins."""
    bins: list[list[tuple[float, bool]]] = [[] for _ in range(n_bins)]
    for p, t in zip(probs, targets):
        conf = max(p)
        bins[_bin(conf, n_bins)].append((conf, winner(p) == t))
    n = len(targets)
    total = 0.0
    for b in bins:
        if b:
            total += len(b) / n * abs(sum(c for c, _ in b) / len(b) - sum(ok for _, ok in b) / len(b))
    return total


def coverage_at_precision(confidences: Sequence[float], correct: Sequence[bool],
                          target_precision: float = 0.99) -> dict[str, Any]:
    """The largest share of rows with confidence >= a threshold whose precision stays at the
    target; coverage 0 and threshold None when no threshold reaches it. Cuts fall only between
    distinct confidences."""
    pairs = sorted(zip(confidences, correct), key=lambda x: -x[0])
    n = len(pairs)
    best: dict[str, Any] = {"coverage": 0.0, "threshold": None, "precision": None, "n_auto": 0,
                            "n": n, "target_precision": target_precision}
    hits = 0
    for i, (conf, ok) in enumerate(pairs, 1):
        hits += bool(ok)
        if i < n and pairs[i][0] == conf:
            continue
        precision = hits / i
        if precision >= target_precision:
            best = {"coverage": i / n, "threshold": conf, "precision": precision, "n_auto": i,
                    "n": n, "target_precision": target_precision}
    return best


def block(rows: Sequence[dict[str, Any]],
          target_precisions: Sequence[float] = TARGET_PRECISIONS) -> dict[str, Any]:
    """One block of ``summarize`` (rows must not be empty)."""
    probs = [r["probs"] for r in rows]
    targets = [r["target"] for r in rows]
    preds = [winner(p) for p in probs]
    out: dict[str, Any] = {"n": len(rows), "accuracy": accuracy(preds, targets),
                           "nll": nll(probs, targets), "brier": brier(probs, targets),
                           "ece": ece(probs, targets)}
    if len({len(p) for p in probs}) == 1:
        out["macro_f1"] = macro_f1(preds, targets, len(probs[0]))
    confidences = [max(p) for p in probs]
    correct = [a == b for a, b in zip(preds, targets)]
    out["auto_decide"] = {f"{tp:g}": coverage_at_precision(confidences, correct, tp)
                          for tp in target_precisions}
    return out


def _grouped(rows: Sequence[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return groups


def summarize(rows: Sequence[dict[str, Any]],
              target_precisions: Sequence[float] = TARGET_PRECISIONS) -> dict[str, Any]:
    """``{"overall", "per_question"}`` exactly as clef-finetune's ``summarize``."""
    return {"overall": block(rows, target_precisions) if rows else {},
            "per_question": {q: block(v, target_precisions)
                             for q, v in _grouped(rows, "question_id").items()}}


def reliability(rows: Sequence[dict[str, Any]], n_bins: int = ECE_BINS) -> list[dict[str, Any]]:
    """The bins behind ``ece``: range, count, mean confidence and accuracy of each (empty bins
    have None for both means)."""
    bins: list[list[tuple[float, bool]]] = [[] for _ in range(n_bins)]
    for r in rows:
        p = r["probs"]
        conf = max(p)
        bins[_bin(conf, n_bins)].append((conf, winner(p) == r["target"]))
    return [{"lo": i / n_bins, "hi": (i + 1) / n_bins, "n": len(b),
             "confidence": sum(c for c, _ in b) / len(b) if b else None,
             "accuracy": sum(ok for _, ok in b) / len(b) if b else None}
            for i, b in enumerate(bins)]


def full(rows: Sequence[dict[str, Any]],
         target_precisions: Sequence[float] = TARGET_PRECISIONS) -> dict[str, Any]:
    """``summarize`` plus a ``per_type`` block and the overall reliability table."""
    out = summarize(rows, target_precisions)
    out["per_type"] = {t: block(v, target_precisions) for t, v in _grouped(rows, "type").items()}
    out["reliability"] = reliability(rows)
    return out
