"""``evaluate.decision_index``: accuracy, macro-F1 over option keys, case-exact and coverage per benchmark,
checked against numbers worked out by hand, and the per-benchmark deltas of a quant to the reference."""

from __future__ import annotations

import math

import pytest

from clef_gguf.evaluate import decision_index

NOUL = ["true", "false"]
TEAM = ["billing", "sales", "support"]


def q(options: list[str], chosen: str) -> dict:
    probs = [0.8 if o == chosen else 0.2 / (len(options) - 1) for o in options]
    return {"type": "noul" if options == NOUL else "choice", "option_ids": options, "probs": probs}


def line(i: int, answers: dict[str, tuple[list[str], str]], expected: dict[str, str]) -> dict:
    questions = {qid: q(opts, chosen) for qid, (opts, chosen) in answers.items()}
    targets = {qid: answers[qid][0].index(key) for qid, key in expected.items()}
    return {"id": str(i), "record_id": f"r{i}", "tokens": 10, "questions": questions, "targets": targets}


def refused(i: int) -> dict:
    return {"id": str(i), "record_id": f"r{i}", "error": {"code": "context_too_large", "message": "too long"}}


# Benchmark A: 4 rows, one refused; B: 2 rows of one noul question.
REFERENCE = [
    line(0, {"u": (NOUL, "true"), "t": (TEAM, "support")}, {"u": "true", "t": "support"}),   # both right
    line(1, {"u": (NOUL, "true"), "t": (TEAM, "billing")}, {"u": "false", "t": "billing"}),  # u wrong
    line(2, {"u": (NOUL, "false"), "t": (TEAM, "sales")}, {"u": "false", "t": "support"}),   # t wrong
    refused(3),
    line(4, {"u": (NOUL, "true")}, {"u": "true"}),
    line(5, {"u": (NOUL, "true")}, {"u": "false"}),
]
BENCHMARKS = {0: "A", 1: "A", 2: "A", 3: "A", 4: "B", 5: "B"}


def f1(tp, fp, fn):
    return 2 * tp / (2 * tp + fp + fn)


def test_the_numbers_of_each_benchmark():
    got = decision_index.table(REFERENCE, BENCHMARKS, {"A": ["ndcg@10"]}, seed=0, resamples=200)
    a, b = got["A"], got["B"]
    assert (a["rows"], a["answered"]) == (4, 3) and a["coverage"]["value"] == 0.75
    assert a["accuracy"]["k"] == 4 and a["accuracy"]["n"] == 6
    assert a["case_exact"]["value"] == pytest.approx(1 / 3)
    # keys: true (tp 1, fp 1: row 1), false (tp 1, fn 1), billing (tp 1), sales (fp 1), support (tp 1, fn 1)
    want = (f1(1, 1, 0) + f1(1, 0, 1) + f1(1, 0, 0) + f1(0, 1, 0) + f1(1, 0, 1)) / 5
    assert a["macro_f1"]["value"] == pytest.approx(want) and a["macro_f1"]["keys"] == sorted(
        ["true", "false", "billing", "sales", "support"])
    lo, hi = a["macro_f1"]["ci95"]
    assert 0 <= lo <= hi <= 1
    for share in ("coverage", "accuracy", "case_exact"):
        lo, hi = a[share]["ci95"]
        assert lo <= a[share]["value"] <= hi
    assert a["unanswered"] == [{"row": 4, "id": "r3", "code": "context_too_large", "message": "too long"}]
    assert a["not_computed"] == ["ndcg@10"] and b["not_computed"] == []
    assert b["accuracy"]["value"] == 0.5 and b["coverage"]["value"] == 1.0 and b["unanswered"] == []


def test_a_quant_against_the_reference_per_benchmark():
    model = list(REFERENCE)
    model[1] = line(1, {"u": (NOUL, "false"), "t": (TEAM, "billing")}, {"u": "false", "t": "billing"})  # now right
    model[5] = refused(5)
    got = decision_index.deltas(REFERENCE, model, BENCHMARKS, seed=0, resamples=200)
    a, b = got["A"], got["B"]
    assert a["agreement"]["n"] == 6 and a["agreement"]["top1"] == pytest.approx(5 / 6)
    assert a["accuracy"]["delta"] == pytest.approx(1 / 6) and a["case_exact"]["delta"] == pytest.approx(1 / 3)
    assert a["coverage"] == 0 and a["rows_compared"] == 3
    assert b["coverage"] == -0.5 and b["rows_compared"] == 1 and b["accuracy"]["delta"] == 0
    assert not b["accuracy"]["significant"]
    same = decision_index.deltas(REFERENCE, REFERENCE, BENCHMARKS, seed=0, resamples=50)
    assert all(same[n][m]["delta"] == 0 and same[n][m]["ci95"] == [0, 0] for n in "AB" for m in decision_index.DELTAS
               if not math.isnan(same[n][m]["delta"]))


def test_rows_are_paired_by_id_when_the_model_misses_one():
    # the model's run lacks row 0: rows 1 and 2 must meet their own reference rows, not their neighbours
    model = [REFERENCE[2], REFERENCE[1], *REFERENCE[3:]]
    got = decision_index.deltas(REFERENCE, model, BENCHMARKS, seed=0, resamples=50)["A"]
    assert got["rows_compared"] == 2 and got["agreement"]["top1"] == 1.0
    assert all(got[m]["delta"] == 0 and got[m]["ci95"] == [0, 0] for m in decision_index.DELTAS)
    assert got["coverage"] == pytest.approx(-0.25)
