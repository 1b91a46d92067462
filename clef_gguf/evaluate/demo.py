"""A labelled demo file for trying eval and calibrate on any model, the random demo one included.

The requests are seeded support tickets with a noul, a choice and a score question. Labels are
drawn (seeded) from the model's own probabilities at ``temperature``: at 2 the model is
over-confident by exactly a factor of 2 in its logits, which ``calibrate`` should find, and at 1
its probabilities are exactly calibrated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from clef_gguf.pipeline import answer
from clef_gguf.core import errors
from clef_gguf.runtime.model import Clef

TEMPERATURE = 2.0
WORDS = ("refund", "login", "invoice", "crash", "slow", "password", "upgrade", "cancel", "error",
         "shipping", "broken", "thanks", "urgent", "account", "billing", "export", "mobile", "api")
QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Does this ticket need a reply within the hour?"},
    "route": {"type": "choice", "instructions": "Which team should handle it?",
              "criteria": {"billing": "payments, invoices, refunds", "support": "how-to questions",
                           "engineering": "bugs and outages", "sales": "plans and upgrades"}},
    "severity": {"type": "score", "instructions": "How severe is the problem?",
                 "criteria": ["none", "minor", "moderate", "major", "critical"]},
}


def requests(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9))))
        out.append({"id": f"demo-{i}", "state": {"ticket": text, "customer_tier": int(rng.integers(1, 4))},
                    "questions": QUESTIONS})
    return out


def labelled(clef: Clef, n: int, *, seed: int = 0, temperature: float = TEMPERATURE) -> list[dict[str, Any]]:
    """``n`` demo requests, each with a label per question drawn from softmax(logits / T)."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for request in requests(n, seed):
        prepared = clef.prepare({k: v for k, v in request.items() if k != "id"})
        enc = prepared.encoded
        probs = answer.split_probabilities(clef.logits(enc), enc.option_counts,
                                           (temperature,) * len(enc.option_counts))
        labels: dict[str, Any] = {}
        for question, p in zip(prepared.request.questions, probs):
            p = np.asarray(p, dtype=np.float64)
            option = question.options[int(rng.choice(len(p), p=p / p.sum()))].id
            labels[question.id] = question.question_type.label_of(option)
        out.append(request | {"labels": labels})
    return out


def write(clef: Clef, path: str | Path, n: int, *, seed: int = 0,
          temperature: float = TEMPERATURE) -> Path:
    """Write the demo file; an existing file is never replaced."""
    path = Path(path)
    lines = "".join(json.dumps(r) + "\n" for r in labelled(clef, n, seed=seed, temperature=temperature))
    try:
        with open(path, "x", encoding="utf-8") as f:
            f.write(lines)
    except FileExistsError:
        raise errors.InvalidValue(f"{path} exists: demo data is written to a new file",
                                  field="data") from None
    return path
