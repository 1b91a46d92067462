"""Label-free agreement of a model with the reference on the same questions: a request file
without labels is enough.

For each question both answered: top-1 agreement (the same first of tied maxima), |Δp| over its
options, and KL(reference ‖ model) in nats (probabilities clipped at 1e-12, in float64).
Summaries: ``n``, ``top1``, ``mean_abs_dp`` (over every option probability), ``max_abs_dp``,
``mean_kl``, ``max_kl``; overall, per question type and per question id, plus the question ids
where the model departs most (highest mean KL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from clef_gguf.core.questions import winner

KL_FLOOR = 1e-12
WORST = 5


def kl(p: np.ndarray, q: np.ndarray) -> float:
    p = np.clip(np.asarray(p, dtype=np.float64), KL_FLOOR, None)
    q = np.clip(np.asarray(q, dtype=np.float64), KL_FLOOR, None)
    return float(np.sum(p * (np.log(p) - np.log(q))))


def pairs(reference: Sequence[dict[str, Any]], model: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per question both runs answered with the same options: its line, question id,
    type, and the two probability vectors."""
    theirs = {line["id"]: line.get("questions", {}) for line in model}
    out = []
    for line in reference:
        other = theirs.get(line["id"], {})
        for qid, q in line.get("questions", {}).items():
            o = other.get(qid)
            if o is not None and o["option_ids"] == q["option_ids"]:
                out.append({"line": line["id"], "question_id": qid, "type": q["type"],
                            "p": np.asarray(q["probs"], dtype=np.float64),
                            "q": np.asarray(o["probs"], dtype=np.float64)})
    return out


def per_pair(pair: dict[str, Any]) -> dict[str, float]:
    p, q = pair["p"], pair["q"]
    return {"top1": float(winner(p) == winner(q)), "max_abs_dp": float(np.max(np.abs(p - q))),
            "sum_abs_dp": float(np.sum(np.abs(p - q))), "n_options": float(len(p)), "kl": kl(p, q)}


def summary(items: Sequence[dict[str, float]]) -> dict[str, Any]:
    if not items:
        return {"n": 0}
    options = sum(i["n_options"] for i in items)
    return {"n": len(items), "top1": sum(i["top1"] for i in items) / len(items),
            "mean_abs_dp": sum(i["sum_abs_dp"] for i in items) / options,
            "max_abs_dp": max(i["max_abs_dp"] for i in items),
            "mean_kl": sum(i["kl"] for i in items) / len(items),
            "max_kl": max(i["kl"] for i in items)}


def compare(reference: Sequence[dict[str, Any]], model: Sequence[dict[str, Any]]) -> dict[str, Any]:
    both = pairs(reference, model)
    scored = [(pair, per_pair(pair)) for pair in both]

    def grouped(key: str) -> dict[str, dict[str, Any]]:
        groups: dict[str, list[dict[str, float]]] = {}
        for pair, s in scored:
            groups.setdefault(pair[key], []).append(s)
        return {k: summary(v) for k, v in groups.items()}

    per_question = grouped("question_id")
    worst = sorted(per_question, key=lambda k: -per_question[k]["mean_kl"])[:WORST]
    return {"overall": summary([s for _, s in scored]), "per_type": grouped("type"),
            "per_question": per_question, "worst_questions": worst}
