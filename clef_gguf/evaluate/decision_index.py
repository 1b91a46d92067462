"""The Decision Index's numbers per benchmark (each of its data sets) of a suite (``evaluate.suite``): the
kit's answer metrics from one model's lines, and for quants side by side their agreement with the
reference and paired deltas. Named after the Decision Index: "benchmarks" alone are timings
(``benchmarks/``, BENCHMARKS.md).

Per benchmark: ``rows``; ``answered``; ``coverage`` = answered / rows; over the labelled questions of the
answered rows ``accuracy`` (top option = the expected key) and ``macro_f1`` (F1 per option key, over the
keys that occur as expected or chosen, averaged); ``case_exact`` = answered rows with every labelled
question right / answered rows. Wilson intervals for the three shares, a seeded bootstrap over rows for
macro-F1. A row the model refused (over the window: ``context_too_large``) is unanswered and listed in
``unanswered`` with its code; it is never truncated to fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from clef_gguf.core.questions import winner
from clef_gguf.evaluate import agreement, stats

SHARES = ("accuracy", "case_exact", "coverage")
DELTAS = ("accuracy", "macro_f1", "case_exact")


class Answers:
    """One benchmark's answered rows as arrays: per row the labelled questions right and asked, whether
    all were right, and per option key the row's true positives, false positives and false negatives."""

    def __init__(self, lines: Sequence[dict[str, Any]], keys: Sequence[str] | None = None) -> None:
        pairs = [[(q["option_ids"][winner(q["probs"])], q["option_ids"][t])
                  for qid, t in line.get("targets", {}).items()
                  for q in (line["questions"][qid],)] for line in lines]
        self.keys = list(keys) if keys is not None else sorted({k for row in pairs for pk in row for k in pk})
        column = {k: i for i, k in enumerate(self.keys)}
        n, c = len(pairs), len(self.keys)
        self.right = np.array([sum(p == t for p, t in row) for row in pairs], dtype=np.float64)
        self.asked = np.array([len(row) for row in pairs], dtype=np.float64)
        self.exact = np.array([bool(row) and all(p == t for p, t in row) for row in pairs], dtype=np.float64)
        self.tp, self.fp, self.fn = (np.zeros((n, c)) for _ in range(3))
        for i, row in enumerate(pairs):
            for p, t in row:
                if p == t:
                    self.tp[i, column[p]] += 1
                else:
                    self.fp[i, column[p]] += 1
                    self.fn[i, column[t]] += 1

    def metrics(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Each metric over every resample (``idx``: [resamples, rows] row indices)."""
        asked = self.asked[idx].sum(axis=1)
        tp, fp, fn = (m[idx].sum(axis=1) for m in (self.tp, self.fp, self.fn))
        denominator = 2 * tp + fp + fn
        occurs = denominator > 0  # keys neither expected nor chosen in a resample do not count
        with np.errstate(invalid="ignore", divide="ignore"):
            f1 = np.where(occurs, 2 * tp / denominator, 0.0).sum(axis=1) / occurs.sum(axis=1)
            return {"accuracy": self.right[idx].sum(axis=1) / asked, "macro_f1": f1,
                    "case_exact": self.exact[idx].mean(axis=1)}


def _share(k: int, n: int) -> dict[str, Any]:
    return {"value": k / n if n else None, "k": k, "n": n, "ci95": list(stats.wilson(k, n)) if n else None}


def _grouped(lines: Sequence[dict[str, Any]], benchmarks: dict[int, str]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        groups.setdefault(benchmarks[int(line["id"])], []).append(line)
    return groups


def _labelled(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if "questions" in line and line.get("targets")]


def one(lines: Sequence[dict[str, Any]], *, seed: int, resamples: int) -> dict[str, Any]:
    """The numbers of one benchmark's lines (every row of it, answered or not)."""
    answered = [line for line in lines if "questions" in line]
    scored = _labelled(lines)
    out: dict[str, Any] = {"rows": len(lines), "answered": len(answered),
                           "coverage": _share(len(answered), len(lines))}
    data = Answers(scored)
    out["accuracy"] = _share(int(data.right.sum()), int(data.asked.sum()))
    out["case_exact"] = _share(int(data.exact.sum()), len(scored))
    point = data.metrics(np.arange(len(scored))[None, :])["macro_f1"][0] if scored else float("nan")
    f1: dict[str, Any] = {"value": None if np.isnan(point) else float(point), "n": len(scored), "ci95": None}
    if scored and not np.isnan(point):
        idx = np.random.default_rng(seed).integers(0, len(scored), size=(resamples, len(scored)))
        lo, hi = np.nanpercentile(data.metrics(idx)["macro_f1"], [2.5, 97.5])
        f1["ci95"] = [float(lo), float(hi)]
    out["macro_f1"] = f1 | {"keys": data.keys}
    out["unanswered"] = [{"row": int(line["id"]) + 1, "id": line.get("record_id"),
                          "code": (line.get("error") or {}).get("code"),
                          "message": (line.get("error") or {}).get("message")}
                         for line in lines if "questions" not in line]
    return out


def table(lines: Sequence[dict[str, Any]], benchmarks: dict[int, str], not_computed: dict[str, list[str]],
          *, seed: int, resamples: int) -> dict[str, dict[str, Any]]:
    """Benchmark -> ``one``'s numbers, plus the metrics its rows name that were not computed."""
    return {name: one(group, seed=seed, resamples=resamples) | {"not_computed": not_computed.get(name, [])}
            for name, group in sorted(_grouped(lines, benchmarks).items())}


def deltas(reference: Sequence[dict[str, Any]], model: Sequence[dict[str, Any]], benchmarks: dict[int, str],
           *, seed: int, resamples: int) -> dict[str, dict[str, Any]]:
    """Benchmark -> the model's top-1 agreement with the reference on the questions both answered, and
    model - reference of accuracy, macro-F1 and case-exact on the rows both answered (paired bootstrap
    over rows, 95%; ``significant`` when the interval excludes 0), and of coverage (a count, no interval)."""
    theirs = {line["id"]: line for line in model}
    out = {}
    for name, group in sorted(_grouped(reference, benchmarks).items()):
        other = [theirs[line["id"]] for line in group if line["id"] in theirs]
        both = [(a, theirs[a["id"]]) for a in group if a["id"] in theirs and a.get("targets")
                and "questions" in a and "questions" in theirs[a["id"]]]
        pairs = agreement.pairs(group, other)
        entry: dict[str, Any] = {"agreement": agreement.summary([agreement.per_pair(p) for p in pairs]),
                                 "rows_compared": len(both),
                                 "coverage": sum("questions" in b for b in other) / len(group)
                                 - sum("questions" in a for a in group) / len(group)}
        if both:
            ref_rows, mod_rows = [a for a, _ in both], [b for _, b in both]
            keys = sorted({*Answers(ref_rows).keys, *Answers(mod_rows).keys})
            ref, mod = Answers(ref_rows, keys), Answers(mod_rows, keys)
            idx = np.random.default_rng(seed).integers(0, len(both), size=(resamples, len(both)))
            everything = np.arange(len(both))[None, :]
            point_ref, point_mod = ref.metrics(everything), mod.metrics(everything)
            boot_ref, boot_mod = ref.metrics(idx), mod.metrics(idx)
            for metric in DELTAS:
                delta = float(point_mod[metric][0] - point_ref[metric][0])
                lo, hi = (float(v) for v in np.nanpercentile(boot_mod[metric] - boot_ref[metric], [2.5, 97.5]))
                entry[metric] = {"reference": float(point_ref[metric][0]), "model": float(point_mod[metric][0]),
                                 "delta": delta, "ci95": [lo, hi], "significant": not lo <= 0.0 <= hi}
        out[name] = entry
    return out
