"""Our metrics equal clef-finetune's ``metrics.summarize`` (the oracle, a test dependency) number
for number, on random rows and on the edge cases."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from clef_finetune import metrics as oracle  # a test dependency: its absence fails the run

from clef_gguf.evaluate import metrics


def same(a, b) -> bool:
    """Equal dicts/lists/numbers, nan equal to nan."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b and type(a) is type(b)


def softmax32(z):
    e = np.exp(np.asarray(z, dtype=np.float32) - np.max(z))
    return (e / e.sum(dtype=np.float32)).astype(np.float32).tolist()


def random_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    shapes = {"urgent": ("noul", 2), "route": ("choice", 4), "severity": ("score", 5), "big": ("choice", 12)}
    rows = []
    for i in range(n):
        qid = rng.choice(sorted(shapes))
        qtype, k = shapes[qid]
        probs = softmax32([rng.gauss(0, 2.5) for _ in range(k)])
        rows.append({"record_id": f"r{i}", "question_id": qid, "type": qtype,
                     "option_ids": [str(j) for j in range(k)], "probs": probs, "target": rng.randrange(k)})
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_rows_equal_the_oracle(seed):
    rows = random_rows(400, seed)
    assert same(metrics.summarize(rows), oracle.summarize(rows))


def test_edge_cases_equal_the_oracle():
    tie = {"record_id": None, "question_id": "t", "type": "choice", "option_ids": ["a", "b"],
           "probs": [0.5, 0.5], "target": 1}
    certain = {"record_id": None, "question_id": "c", "type": "noul", "option_ids": ["true", "false"],
               "probs": [1.0, 0.0], "target": 1}  # p(target) = 0: the 1e-12 clip
    one_class = [{"record_id": i, "question_id": "one", "type": "score", "option_ids": ["0", "1", "2"],
                  "probs": [0.2, 0.7, 0.1], "target": 1} for i in range(5)]
    mixed = [dict(tie, question_id="m"), dict(tie, question_id="m", option_ids=["a", "b", "c"],
                                             probs=[0.2, 0.3, 0.5], target=2)]  # no macro_f1
    exact_bin = [dict(tie, question_id="e", probs=[0.3, 0.7], target=0),  # a confidence on a bin edge
                 dict(tie, question_id="e", probs=[1.0, 0.0], target=0)]  # confidence 1: last bin
    for rows in ([], [tie], [certain], one_class, mixed, exact_bin,
                 [tie, certain, *one_class, *mixed, *exact_bin]):
        ours, theirs = metrics.summarize(rows), oracle.summarize(rows)
        assert same(ours, theirs), rows
    assert metrics.summarize([]) == {"overall": {}, "per_question": {}}
    assert "macro_f1" not in metrics.summarize(mixed)["overall"]
    assert metrics.summarize(exact_bin)["overall"]["auto_decide"]["0.99"]["threshold"] == 1.0


def test_auto_decide_and_precisions_equal_the_oracle():
    rows = random_rows(300, 7)
    for tps in ((0.99, 0.95), (0.9,), (0.5, 0.8, 0.999)):
        assert same(metrics.summarize(rows, tps), oracle.summarize(rows, tps))


def test_full_adds_per_type_and_reliability_without_changing_summarize():
    rows = random_rows(200, 3)
    full = metrics.full(rows)
    assert same({k: full[k] for k in ("overall", "per_question")}, oracle.summarize(rows))
    assert set(full["per_type"]) == {r["type"] for r in rows}
    for qtype, block in full["per_type"].items():
        assert same(block, oracle.summarize([r for r in rows if r["type"] == qtype])["overall"])
    bins = full["reliability"]
    assert len(bins) == 10 and sum(b["n"] for b in bins) == len(rows)
    ece = sum(b["n"] / len(rows) * abs(b["confidence"] - b["accuracy"]) for b in bins if b["n"])
    assert ece == pytest.approx(full["overall"]["ece"], abs=1e-12)
