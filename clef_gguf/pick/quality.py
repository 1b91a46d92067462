"""``pick --eval DIR``: the smallest quant that fits this machine and keeps its answers, as measured
by ``clef-gguf eval`` on the user's own records.

A quant keeps its answers when its top-1 agreement with the eval's reference is at least
``--min-agreement``; without that flag, when its accuracy delta to the reference is not
significantly negative (the paired-bootstrap interval reaches 0 or above) on labelled records, nor on
any benchmark of a Decision Index suite, else (no labels) when its top-1 agreement is at least
``DEFAULT_AGREEMENT``. The reference keeps its own
answers by definition. Quants the eval did not run are not chosen: nothing was measured for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from clef_gguf.core import errors
from clef_gguf.models.placement import Candidate, Recommendation

DEFAULT_AGREEMENT = 0.99
SUMMARY = "summary.json"


@dataclasses.dataclass(frozen=True)
class Verdict:
    quant: str  # upper case, as the catalog spells quant types
    keeps: bool
    why: str


def agreement(text: str) -> float:
    """``--min-agreement``: a share of questions, 0..1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share between 0 and 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie between 0 and 1 (got {text})")
    return value


def load(directory: str | Path) -> dict[str, Any]:
    """The eval's summary.json (a side-by-side run: at least two models)."""
    path = Path(directory) / SUMMARY
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise errors.InvalidValue(f"cannot read {path}: {exc.strerror} (give --eval the --output "
                                  "directory of a clef-gguf eval with several --model)", field="eval") from None
    except ValueError:
        raise errors.InvalidValue(f"{path} is not an eval summary", field="eval") from None
    if not isinstance(summary, dict) or len(summary.get("models") or []) < 2:
        raise errors.InvalidValue(f"{path} holds one model: pick --eval needs quants compared side by "
                                  "side (clef-gguf eval --model REFERENCE --model QUANT ...)", field="eval")
    return summary


def verdicts(summary: dict[str, Any], min_agreement: float | None) -> dict[str, Verdict]:
    """Quant (upper case) -> whether it keeps the reference's answers, and why in words. Two runs of one
    quant type (from two sources, say) give one verdict: the one that does not keep, if either."""
    models = summary["models"]
    ref = models[0]
    ref_quant = str(ref["info"].get("quant") or "").upper()
    out = {ref_quant: Verdict(ref_quant, True, f"{ref_quant} is the eval's reference")}
    for m in models[1:]:
        quant = str(m["info"].get("quant") or "").upper()
        if m["info"].get("calibration_version", "none") != "none":
            continue  # a calibrated run speaks for the quant with that file, not for plain pulls
        agreement = (m.get("agreement") or {}).get("overall") or {}
        top1, n = agreement.get("top1"), agreement.get("n", 0)
        accuracy = (m.get("deltas") or {}).get("accuracy")
        said = (f"top-1 agreement {top1:.4f} with {ref_quant} on {n} questions"
                if top1 is not None else f"no question in common with {ref_quant}")
        if min_agreement is not None or not accuracy:
            threshold = DEFAULT_AGREEMENT if min_agreement is None else min_agreement
            keeps = top1 is not None and top1 >= threshold
            why = f"{said} ({'>=' if keeps else '<'} {threshold:g})"
        else:
            lo, hi = accuracy["ci95"]
            keeps = hi >= 0.0
            why = (f"accuracy delta {accuracy['delta']:+.4f} [{lo:+.4f}, {hi:+.4f}] vs {ref_quant} on "
                   f"{(m.get('deltas') or {}).get('n', n)} labelled questions "
                   f"({'within' if keeps else 'below'} the 95% bootstrap interval of no loss); {said}")
        worse = [] if min_agreement is not None else _worse_benchmarks(m)
        if worse and keeps:
            keeps, why = False, f"{why}; but significantly less accurate on {'; '.join(worse)}"
        if quant not in out or (out[quant].keeps and not keeps):
            out[quant] = Verdict(quant, keeps, why)
    return out


def _worse_benchmarks(model: dict[str, Any]) -> list[str]:
    """The Decision Index benchmarks (an eval of suite rows) where ``model``'s accuracy delta to the
    reference is significantly negative: its 95% interval lies below 0."""
    worse = []
    for name, d in sorted((model.get("benchmark_deltas") or {}).items()):
        accuracy = d.get("accuracy")
        if accuracy and accuracy["ci95"][1] < 0.0:
            lo, hi = accuracy["ci95"]
            worse.append(f"{name} ({accuracy['delta']:+.4f} [{lo:+.4f}, {hi:+.4f}])")
    return worse


def agreements(summary: dict[str, Any]) -> dict[str, float]:
    """Quant (upper case) -> its top-1 agreement with the eval's reference (1.0 for the reference), for
    ``pick``'s table; a quant run twice shows the lower."""
    models = summary["models"]
    out = {str(models[0]["info"].get("quant") or "").upper(): 1.0}
    for m in models[1:]:
        top1 = ((m.get("agreement") or {}).get("overall") or {}).get("top1")
        quant = str(m["info"].get("quant") or "").upper()
        if top1 is not None and m["info"].get("calibration_version", "none") == "none":
            out[quant] = min(out.get(quant, 1.0), float(top1))
    return out


def choose(candidates: list[Candidate], found: dict[str, Verdict]) -> tuple[Candidate | None, str]:
    """The smallest candidate that fits and keeps its answers, and the sentence that says why."""
    judged = [(c, found[c.quant.upper()]) for c in candidates if c.quant.upper() in found]
    keeping = sorted((c for c, v in judged if v.keeps and (c.fits_cpu or c.fits_gpu)),
                     key=lambda c: c.size_bytes)
    if not judged:
        return None, ("None of the quants this eval compared is in the catalog's list for this family "
                      f"({', '.join(sorted(found))}): the memory-only choice stands.")
    if not keeping:
        reasons = "; ".join(f"{q}: {v.why}" for q, v in found.items())
        return None, (f"No quant the eval compared both fits this machine and keeps the reference's "
                      f"answers ({reasons}): the memory-only choice stands.")
    best = keeping[0]
    rejected = [f"{c.quant} ({v.why})" for c, v in judged
                if not v.keeps and c.size_bytes < best.size_bytes and (c.fits_cpu or c.fits_gpu)]
    text = (f"{best.quant} is the smallest quant that fits and keeps the reference's answers on your "
            f"records: {found[best.quant.upper()].why}.")
    if rejected:
        text += f" Smaller but rejected by the eval: {'; '.join(rejected)}."
    return best, text


def apply(recommendation: Recommendation, summary: dict[str, Any],
          min_agreement: float | None) -> Recommendation:
    """``recommendation`` re-chosen with what the eval measured:
    its quant, source, placement and need are the chosen candidate's, and its reason says why."""
    best, text = choose(list(recommendation.candidates), verdicts(summary, min_agreement))
    if best is None:
        return dataclasses.replace(recommendation, reason=f"{recommendation.reason} {text}")
    placement = "gpu" if best.fits_gpu else "cpu"
    return dataclasses.replace(recommendation, quant=best.quant, source=best.source, placement=placement,
                               need_bytes=best.need_bytes, reason=text)
